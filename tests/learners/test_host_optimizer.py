"""optimizer_offload: the host step equals torch's AdamW on fp32 weights, bucket by bucket,
with bf16 compute weights rounded from the masters; checkpoints keep the device format.

The device is the CPU here: the same bucketed copy path runs, with synchronous copies."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from learner_helpers import actor_config, make_batch, tiny_model

import hybridflow.learners.actor_learner as actor_learner
from hybridflow.learners.core import TrainCore
from hybridflow.learners.host_optimizer import plan_buckets
from hybridflow.learners.modules import PolicyModel
from hybridflow.learners.optim import build_scheduler, clip_grad_norm

OPTIMIZER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
SCHEDULE = dict(schedule="linear", warmup_steps=1, total_steps=6, min_lr_ratio=0.1)


def offloaded_core(bucket_elements: int = 5000, seed: int = 0) -> TrainCore:
    """The tiny policy with bf16 compute weights on the "device" and fp32 masters on the host,
    in buckets of at most 5,000 parameters (the tiny model's ~0.1 M make ~20)."""
    core = TrainCore(PolicyModel(tiny_model(seed)), device="cpu", mixed_precision=True,
                     optimizer_offload=True)  # fmt: skip
    core.build_optimizer(**OPTIMIZER, **SCHEDULE, bucket_elements=bucket_elements)
    return core


def fake_gradients(params, step: int) -> list[torch.Tensor]:
    """bf16 gradients (what the device's backward gives), large enough to be clipped."""
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(p.shape, generator=g) * 0.5).to(torch.bfloat16) for p in params]


def test_buckets_group_consecutive_tensors_and_a_large_one_alone():
    assert plan_buckets([3, 3, 3, 10, 1, 1], 6) == [[0, 1], [2], [3], [4, 5]]
    assert plan_buckets([7], 6) == [[0]]


def test_host_step_equals_adamw_on_fp32_weights_with_clipping_decay_and_a_skipped_step():
    reference_model = PolicyModel(tiny_model())  # fp32, what the masters must follow
    core = offloaded_core()
    host = core.host_optimizer
    assert len(host.buckets) > 5  # the bucketed path, not one bucket
    params = core.trainable_parameters
    reference = list(reference_model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)  # the compute copies
    reference_optimizer = torch.optim.AdamW(reference, **OPTIMIZER)
    reference_schedule = build_scheduler(reference_optimizer, **SCHEDULE)
    for step in range(5):
        grads = fake_gradients(params, step)
        if step == 2:  # a non-finite gradient: the step is skipped, the schedule advances
            grads[3].view(-1)[0] = float("inf")
        for param, ref, grad in zip(params, reference, grads):
            param.grad, ref.grad = grad.clone(), grad.float()
        before = [m.clone() for m in host.masters]
        norm, skipped = core.optimizer_step(grad_clip=1.0)
        reference_norm = clip_grad_norm(reference, 1.0)
        if math.isfinite(reference_norm):
            reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        core.scheduler_step()
        reference_schedule.step()

        assert skipped == (step == 2)
        if skipped:
            assert math.isinf(norm)
            assert all(torch.equal(a, b) for a, b in zip(before, host.masters))
        else:
            assert norm == pytest.approx(reference_norm, rel=1e-6) and norm > 1.0  # clipped
        assert all(p.grad is None for p in params)  # freed on the device
        for master, ref, param in zip(host.masters, reference, params):
            torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)
            assert torch.equal(param.detach(), master.to(torch.bfloat16))  # rounded from it
        assert core.optimizer.param_groups[0]["lr"] == reference_optimizer.param_groups[0]["lr"]
    steps = {float(core.optimizer.state[m]["step"]) for m in host.masters}
    assert steps == {4.0}  # five calls, one skipped


def train_steps(core: TrainCore, steps: range) -> None:
    for step in steps:
        for param, grad in zip(core.trainable_parameters,
                               fake_gradients(core.trainable_parameters, step)):  # fmt: skip
            param.grad = grad
        core.optimizer_step(grad_clip=1.0)
        core.scheduler_step()


def test_checkpoint_round_trip_resumes_exactly_and_keeps_the_device_format(tmp_path):
    straight = offloaded_core()
    train_steps(straight, range(4))
    first = offloaded_core()
    train_steps(first, range(2))
    first.save(tmp_path / "offloaded", {}, trainable_only=False)
    resumed = offloaded_core(seed=3)  # other weights: all of them must come from the file
    resumed.load(tmp_path / "offloaded", trainable_only=False)
    for master, saved in zip(resumed.host_optimizer.masters, first.host_optimizer.masters):
        assert torch.equal(master, saved)
    train_steps(resumed, range(2, 4))
    for a, b in zip(straight.host_optimizer.masters, resumed.host_optimizer.masters):
        assert torch.equal(a, b)
    for a, b in zip(straight.trainable_parameters, resumed.trainable_parameters):
        assert torch.equal(a, b)
    state_a, state_b = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for index, entry in state_a["state"].items():
        assert all(torch.equal(entry[k], state_b["state"][index][k]) for k in entry)

    # The same checkpoint loads into an optimizer on the device, and the other way round:
    # the files hold fp32 weights and AdamW state under the parameters' names either way.
    on_device = TrainCore(PolicyModel(tiny_model(seed=5)), device="cpu")
    on_device.build_optimizer(**OPTIMIZER, **SCHEDULE)
    on_device.load(tmp_path / "offloaded", trainable_only=False)
    names = [n for n, _ in on_device.module.named_parameters()]
    for name, param, master in zip(names, on_device.trainable_parameters,
                                   first.host_optimizer.masters):  # fmt: skip
        assert torch.equal(param.detach(), master), name
        moment = on_device.optimizer.state[param]["exp_avg"]
        assert torch.equal(moment, first.optimizer.state[master]["exp_avg"]), name
    on_device.save(tmp_path / "on_device", {}, trainable_only=False)
    back = offloaded_core(seed=7)
    back.load(tmp_path / "on_device", trainable_only=False)
    for a, b in zip(back.host_optimizer.masters, first.host_optimizer.masters):
        assert torch.equal(a, b)


def test_exported_weights_are_the_fp32_masters():
    core = offloaded_core()
    train_steps(core, range(1))
    full = dict(core.iter_full_tensors(core.module))
    named = dict(core.module.named_parameters())
    for name, master in zip(named, core.host_optimizer.masters):
        assert full[name].dtype == torch.float32 and torch.equal(full[name], master)
    assert core.master_dtype() == torch.float32


def test_fsdp_with_optimizer_offload_names_param_offload():
    with pytest.raises(ValueError, match="param_offload"):
        TrainCore(copy.deepcopy(PolicyModel(tiny_model())), device="cpu", fsdp=True,
                  optimizer_offload=True)  # fmt: skip


def test_actor_update_trains_the_same_as_autocast_over_device_masters(monkeypatch):
    """bf16 compute as on CUDA (autocast on the CPU): the first forward is bit-identical
    (bf16 copies rounded from the masters = autocast's casts), later steps differ only by
    the bf16 rounding of the gradients."""
    monkeypatch.setattr(actor_learner, "TrainCore",
                        functools.partial(TrainCore, mixed_precision=True))  # fmt: skip
    runs = []
    for offload in (False, True):
        actor = actor_learner.ActorLearner(tiny_model(), actor_config(optimizer_offload=offload),
                                           total_steps=4, device="cpu")  # fmt: skip
        runs.append([actor.update(make_batch(seed=i)) for i in range(2)])
    (first_a, second_a), (first_b, second_b) = runs
    assert first_b["pg_loss"] == first_a["pg_loss"]
    assert first_b["grad_norm"] == pytest.approx(first_a["grad_norm"], rel=1e-3)
    assert second_b["pg_loss"] == pytest.approx(second_a["pg_loss"], rel=1e-3)
