"""actor.optimizer_offload on a real GPU: one GRPO step of the 0.5b preset peaks lower by about
the masters and AdamW state the plan moves to the host, and trains the same (needs CUDA).

    python -m pytest -m gpu tests/trainer/test_offload_gpu.py -s
"""

import gc

import pytest
import torch
from trainer_helpers import read_metrics

from hybridflow.config import load_config, validate
from hybridflow.trainer import memory_plan as mp
from hybridflow.trainer.memory_check import plan_for_config
from hybridflow.trainer.memory_render import render

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Computed from the same rollout (both runs sample with the bf16 rounding of the same fp32
# weights); the update then differs by the bf16 rounding of the gradients.
COMPARED = ("actor/grad_norm", "actor/pg_loss", "actor/ppo_kl", "score/mean",
            "response_length/mean")  # fmt: skip


def overrides(run_dir, offload: bool) -> list[str]:
    """One GRPO step: 32 prompts × 4 samples of up to 64 + 448 tokens (full length), two
    optimizer steps, 16,384-token micro-batches, fp32 masters (model.dtype=auto)."""
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
        f"actor.optimizer_offload={str(offload).lower()}",
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.loggers=[jsonl]",
        f"trainer.run_dir={run_dir}",
    ]


def peak_of_one_step(cfg) -> int:
    from hybridflow.trainer.run import train

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    train(cfg, log=lambda *args, **kwargs: None)
    peak = torch.cuda.max_memory_allocated()
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def test_offload_lowers_the_peak_by_the_masters_and_moments_and_trains_the_same(tmp_path):
    on_gpu = load_config(None, overrides(tmp_path / "gpu", offload=False))
    offloaded = load_config(None, overrides(tmp_path / "host", offload=True))
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    plan = plan_for_config(offloaded, validate(offloaded), gpu_bytes)
    moved = {i.name: i.host_bytes for i in plan.items}
    master_and_state = moved["actor master weights (fp32)"] + moved["optimizer state (AdamW, fp32)"]

    peak_gpu, peak_host = peak_of_one_step(on_gpu), peak_of_one_step(offloaded)
    report = (f"{render(plan)}\npeak with AdamW on the GPU {peak_gpu / mp.GIB:.2f} GiB, on the "
              f"host {peak_host / mp.GIB:.2f} GiB; masters + moments {master_and_state / mp.GIB:.2f} GiB")  # fmt: skip
    print(report)
    assert peak_gpu - peak_host >= 0.8 * master_and_state, report

    a, b = read_metrics(on_gpu.trainer.run_dir)[1], read_metrics(offloaded.trainer.run_dir)[1]
    for key in COMPARED:
        assert b[key] == pytest.approx(a[key], rel=0.02, abs=1e-4), (key, a[key], b[key])
