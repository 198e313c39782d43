import math

import pytest
import torch

from hybridflow.learners.optim import (
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    lr_multiplier,
)


def test_lr_schedules_hand_computed():
    kw = dict(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    # Warm-up: (step + 1) / (warmup + 1): 0.2, 0.4, 0.6, 0.8, then 1 at step 4.
    assert [lr_multiplier(s, schedule="constant", **kw) for s in range(6)] == pytest.approx(
        [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    )
    # Linear decay over 10 steps from 1 to 0.1: halfway (step 9) = 0.1 + 0.9 * 0.5 = 0.55.
    assert lr_multiplier(9, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_multiplier(14, schedule="linear", **kw) == pytest.approx(0.1)
    assert lr_multiplier(40, schedule="linear", **kw) == pytest.approx(0.1)
    # Cosine halfway: 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55; a quarter: 0.1 + 0.45 (1 + cos(pi/4)).
    assert lr_multiplier(9, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_multiplier(6.5, schedule="cosine", **kw) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi / 4))
    )
    assert lr_multiplier(14, schedule="cosine", **kw) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="known"):
        lr_multiplier(0, schedule="step", warmup_steps=0, total_steps=1)


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([p], lr=1.0)
    sched = build_scheduler(opt, schedule="linear", warmup_steps=1, total_steps=3, min_lr_ratio=0.0)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()  # before the scheduler's step, as in training (torch warns otherwise)
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 0.5, 0.0])


def test_clip_grad_norm_clips_and_reports_nonfinite():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    assert torch.cat([a.grad, b.grad]).norm() == pytest.approx(1.0, rel=1e-4)
    a.grad = torch.tensor([float("nan"), 1.0])
    assert not math.isfinite(clip_grad_norm([a, b], 1.0))
    with pytest.raises(ValueError, match="trainable"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1), requires_grad=False)], lr=1.0)
