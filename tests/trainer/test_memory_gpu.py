"""The memory plan against the peak of a real training step (needs a CUDA device)."""

import pytest
import torch

from hybridflow.config import load_config, validate
from hybridflow.trainer import memory_plan as mp
from hybridflow.trainer.memory_check import plan_for_config
from hybridflow.trainer.memory_render import render

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def step_overrides(run_dir) -> list[str]:
    """One GRPO step of the 0.5b preset: 32 prompts × 4 samples of up to 64 + 448 tokens
    (forced to full length), two optimizer steps (the second holds AdamW's state during its
    forward/backward, as every later step does), 16,384-token micro-batches."""
    return [
        "model.path=qwen2.5-0.5b",
        "trainer.device=cuda",
        "data.train_batch_size=32",
        "data.builtin_train_size=64",
        "data.val_files=[]",
        "data.max_prompt_length=64",
        "data.max_response_length=448",
        "rollout.n=4",
        "rollout.ignore_eos=true",
        "rollout.max_num_seqs=128",
        "actor.ppo_mini_batch_size=16",
        "actor.max_tokens_per_gpu=16384",
        "actor.lr=1e-6",
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.loggers=[]",
        f"trainer.run_dir={run_dir}",
    ]


def test_one_step_of_the_0_5b_peaks_within_15_percent_of_the_plan(tmp_path):
    from hybridflow.trainer.run import train

    cfg = load_config(None, step_overrides(tmp_path / "run"))
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    plan = plan_for_config(cfg, validate(cfg), gpu_bytes)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    train(cfg, log=lambda *args, **kwargs: None)
    measured = torch.cuda.max_memory_allocated()
    phase, planned = plan.peak()
    report = f"{render(plan)}\nmeasured peak {measured / mp.GIB:.2f} GiB"
    print(report)
    assert phase == mp.UPDATE, report
    assert abs(planned - measured) / measured < 0.15, report
