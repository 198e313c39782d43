"""The roles as worker groups: the hybrid engine's rollout samples with the actor's own
weights (log-probs agree, so PPO's ratio starts at 1, also right after an update), and the
weight sync of split placement and of a sharded (FSDP2, 2 processes) actor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.controller import ResourcePool, WorkerGroup
from hybridflow.protocol import Batch
from hybridflow.workers import fused_worker

N_SAMPLES = 4


def tiny_config(*overrides: str):
    return load_config(
        None,
        [
            "model.path=tiny",
            "data.max_prompt_length=8",
            "data.max_response_length=6",
            "data.train_batch_size=4",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size_per_gpu=8",
            "actor.lr=1e-2",
            "trainer.device=cpu",
            *overrides,
        ],
    )


def prompts(num: int = 4) -> Batch:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 100, (num, 8), generator=generator)  # [B, P]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ids[1, :3] = 0
    meta = {"n": N_SAMPLES, "temperature": 1.0, "seed": 3, "pad_token_id": 0}
    return Batch({"prompts": ids, "attention_mask": mask}, meta=meta)


def rollout_batch(rollout) -> Batch:
    """Generate, then lay the samples out as the trainer does."""
    request = prompts()
    out = rollout.generate(request)
    rows = request.repeat(N_SAMPLES)
    prompt_mask = rows.tensors.pop("attention_mask")
    batch = rows.union(out)
    batch.tensors["attention_mask"] = torch.cat(
        [prompt_mask, batch.tensors["response_mask"].long()], dim=1
    )
    batch.meta = {"temperature": 1.0}
    return batch


def rollout_matches_actor(rollout, actor) -> float:
    """Max |rollout log-prob - actor log-prob| over the generated tokens."""
    batch = rollout_batch(rollout)
    old = actor.compute_logprobs(batch).tensors["old_logprobs"]
    mask = batch.tensors["response_mask"].bool()
    assert mask.sum() > 0
    return float((old - batch.tensors["rollout_logprobs"])[mask].abs().max())


def actor_update(actor, rollout) -> None:
    batch = rollout_batch(rollout)
    batch = batch.union(actor.compute_logprobs(batch))
    advantages = torch.randn(batch.tensors["response_mask"].shape) * batch.tensors["response_mask"]
    batch.tensors["advantages"] = advantages
    batch.arrays["uid"] = np.arange(len(batch))
    metrics = actor.update(batch)[0]
    assert metrics["actor/grad_norm"] > 0


def test_hybrid_engine_shares_actor_weights_in_place():
    group = WorkerGroup(fused_worker(actor=True, rollout=True), config=tiny_config())
    try:
        worker = group._backend.ranks[0].host.worker  # in-process: look at the tensors
        actor, rollout = worker.roles["actor"], worker.roles["rollout"]
        assert rollout.shares_actor_weights
        assert rollout.engine.model is actor.model
        assert rollout_matches_actor(group.rollout, group.actor) < 1e-4
        actor_update(group.actor, group.rollout)
        # Same weights right after the update, with no sync call.
        assert rollout_matches_actor(group.rollout, group.actor) < 1e-4
    finally:
        group.shutdown()


def test_split_placement_syncs_weights_through_the_controller():
    cfg = tiny_config()
    train = WorkerGroup(fused_worker(actor=True, rollout=False), config=cfg, name="train")
    rollout = WorkerGroup(fused_worker(actor=False, rollout=True), config=cfg, name="rollout")
    try:
        assert rollout_matches_actor(rollout.rollout, train.actor) < 1e-4  # same init
        actor_update(train.actor, rollout.rollout)
        assert rollout_matches_actor(rollout.rollout, train.actor) > 1e-3  # stale copy
        rollout.rollout.load_weights(train.actor.full_weights())
        assert rollout_matches_actor(rollout.rollout, train.actor) < 1e-4
    finally:
        train.shutdown()
        rollout.shutdown()


@pytest.mark.slow
def test_sharded_actor_syncs_to_colocated_rollout_two_processes():
    cfg = tiny_config("trainer.backend=local", "trainer.n_gpus_per_node=2")
    group = WorkerGroup(
        fused_worker(actor=True, rollout=True),
        pool=ResourcePool(cpus=2),
        backend="local",
        config=cfg,
    )
    try:
        actor_update(group.actor, group.rollout)
        assert rollout_matches_actor(group.rollout, group.actor) > 1e-3  # not synced yet
        group.rollout.sync_from_actor()
        assert rollout_matches_actor(group.rollout, group.actor) < 1e-4
    finally:
        group.shutdown()


def test_lora_in_place_rollout_decodes_the_actors_adapters_without_a_copy():
    cfg = tiny_config("model.lora_rank=4", "model.lora_alpha=8", "rollout.lora_in_place=true")
    group = WorkerGroup(fused_worker(actor=True, rollout=True), config=cfg)
    try:
        worker = group._backend.ranks[0].host.worker
        actor, rollout = worker.roles["actor"], worker.roles["rollout"]
        assert rollout.shares_actor_weights and rollout.engine.model is actor.model
        assert rollout.engine.adapted
        assert rollout_matches_actor(group.rollout, group.actor) < 1e-4
        actor_update(group.actor, group.rollout)  # lora_B leaves 0: the adapters now count
        b = next(p for n, p in actor.model.named_parameters() if "lora_B" in n)
        assert b.abs().max() > 0
        # the engine's next tokens come from the updated adapters, with no sync call
        assert rollout_matches_actor(group.rollout, group.actor) < 1e-4
    finally:
        group.shutdown()


def test_idle_cores_are_said_once_with_the_setting_that_uses_them():
    from hybridflow.workers.model_loading import cpu_threads_note

    note = cpu_threads_note(threads=1, processes=1, cores=2)
    assert "1 process × 1 thread use 1 of this host's 2 cores" in note
    assert "trainer.cpu_threads=2" in note
    assert cpu_threads_note(threads=1, processes=2, cores=2) is None  # every core busy
    assert cpu_threads_note(threads=None, processes=1, cores=64) is None  # torch's default


def test_speculative_rollout_reports_its_metrics_with_the_batch():
    from hybridflow.engine.scheduling.tail import TAIL_METRICS
    from hybridflow.engine.speculative import SPECULATIVE_METRICS

    config = tiny_config("rollout.engine.speculative=ngram", "rollout.engine.decode_backend=torch",
                         "data.max_response_length=32",
                         "rollout.engine.speculative_min_ngram=1")  # fmt: skip
    group = WorkerGroup(fused_worker(rollout=True), config=config)
    try:
        out = group.rollout.generate(prompts())
        metrics = out.meta[SPECULATIVE_METRICS]
        assert metrics["rollout/speculative_passes"] > 0
        assert 0 <= metrics["rollout/speculative_acceptance_rate"] <= 1
        assert metrics["rollout/speculative_tokens_per_pass"] >= 1
        assert metrics["rollout/speculative_seconds"] > 0
        tail = out.meta[TAIL_METRICS]  # its rows decode 32 tokens: the last ones in a tail
        assert tail["rollout/tail_seconds"] > metrics["rollout/speculative_seconds"]
    finally:
        group.shutdown()
