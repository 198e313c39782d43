"""actor.optimizer_offload on a real GPU: one GRPO step of the 0.5b preset peaks lower by about
the masters and AdamW state the plan moves to the host, and trains the same (needs CUDA).

    python -m pytest -m gpu tests/trainer/test_offload_gpu.py -s
"""

import gc

import pytest
import torch
from trainer_helpers import one_step_0_5b, read_metrics

from hybridflow.config import load_config, validate
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_from_config import plan_for_config
from hybridflow.trainer.plan.memory_render import render

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Computed from the same rollout (both runs sample with the bf16 rounding of the same fp32
# weights); the update then differs by the bf16 rounding of the gradients.
COMPARED = ("actor/grad_norm", "actor/pg_loss", "actor/ppo_kl", "score/mean",
            "response_length/mean")  # fmt: skip


def overrides(run_dir, offload: bool) -> list[str]:
    """One GRPO step (trainer_helpers.one_step_0_5b), fp32 masters (model.dtype=auto)."""
    return [*one_step_0_5b(run_dir), f"actor.optimizer_offload={str(offload).lower()}",
            "trainer.loggers=[jsonl]"]  # fmt: skip


def peak_of_one_step(cfg) -> int:
    from hybridflow.trainer.lifecycle.run import train

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
