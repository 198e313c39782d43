"""Every example algorithm: a 2-step run through `train()`, and one update that makes the
rewarded samples more likely (the surrogate objective sum_i A_i * delta log-prob rises)."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_helpers import read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import setup, train
from hybridflow.trainer.loop.stages import collect_rollouts, rewards_and_advantages
from hybridflow.trainer.observe.metrics import Timer

STEP_STAGES = ("gen", "gen_baseline", "reward", "old_logprob", "ref", "values", "adv",
               "update_critic", "update_actor", "sync_weights")  # fmt: skip
EXAMPLES = ["grpo", "ppo", "dapo", "rloo", "reinforce_plus_plus", "remax", "gspo"]


def advantage_weighted_logprob_change(run) -> float:
    """One actor update on a fresh batch; returns sum over tokens of A * (logp_after - logp_before)."""
    roles = run.roles
    run.step += 1
    batch, _ = collect_rollouts(run, Timer())
    batch = batch.union(roles.actor.compute_logprobs(batch))
    if roles.ref is not None:
        batch = batch.union(roles.ref.compute_ref_logprobs(batch))
    if roles.critic is not None:
        batch = batch.union(roles.critic.compute_values(batch))
    batch, _ = rewards_and_advantages(run, batch)
    assert batch.tensors["advantages"].abs().sum() > 0, "no learning signal in the test batch"
    roles.actor.update(batch)
    after = roles.actor.compute_logprobs(batch).tensors["old_logprobs"]
    mask = batch.tensors["response_mask"]
    delta = (after - batch.tensors["old_logprobs"]) * mask
    return float((delta * batch.tensors["advantages"]).sum())


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs_two_steps(example, tmp_path, quiet):
    cfg = tiny_config(tmp_path, example=example)
    final = train(cfg, log=quiet)
    metrics = read_metrics(cfg.trainer.run_dir)
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        row = metrics[step]
        for key in ("actor/pg_loss", "actor/grad_norm", "score/mean", "timing_s/gen"):
            assert math.isfinite(row[key]), (example, step, key)
        assert row["timing_s/step"] >= row["timing_s/update_actor"] > 0
        # the reward runs beside the first forward pass, timed in pieces: the stages of the
        # step still add up to no more than it
        stages = [row[f"timing_s/{stage}"] for stage in STEP_STAGES if f"timing_s/{stage}" in row]
        assert "timing_s/reward" in row and sum(stages) <= row["timing_s/step"] + 1e-6
    assert "val/arithmetic/mean@1" in final
    if example == "ppo":
        assert "critic/vf_loss" in metrics[2] and "timing_s/values" in metrics[2]
        assert metrics[2]["actor/reward_kl_penalty_coeff"] > 0
    if example == "remax":
        assert "timing_s/gen_baseline" in metrics[2]
    if example == "dapo":
        assert 1 <= metrics[2]["dynamic_sampling/gen_rounds"] <= 3
        assert "reward/overlong_ratio" in metrics[2]
    if example == "grpo":
        assert "actor/kl_loss" in metrics[2] and "timing_s/ref" in metrics[2]
    # A checkpoint was written at the end.
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE").is_file()


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_update_makes_rewarded_samples_likelier(example, tmp_path, quiet):
    torch.manual_seed(0)
    cfg = tiny_config(tmp_path, "actor.lr=3e-4", "actor.ppo_epochs=1", example=example)
    run = setup(cfg, log=quiet)
    try:
        assert advantage_weighted_logprob_change(run) > 0
    finally:
        run.roles.shutdown()
        run.reward.close()
