"""The memory plan against the peak of a real training step (needs a CUDA device)."""

import pytest
import torch
from trainer_helpers import one_step_0_5b

from hybridflow.config import load_config, validate
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_from_config import plan_for_config
from hybridflow.trainer.plan.memory_render import render

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def step_overrides(run_dir) -> list[str]:
    return [*one_step_0_5b(run_dir), "trainer.loggers=[]"]


def test_one_step_of_the_0_5b_peaks_within_15_percent_of_the_plan(tmp_path):
    from hybridflow.trainer.lifecycle.run import train

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
