"""The on-policy shortcut: no old-log-prob pass, old = sg(current log-probs)."""

import pytest
from learner_helpers import actor_config, flat_params, make_batch, max_abs_diff, tiny_model

from hybridflow.learners import ActorLearner


def _actor(seed: int = 0, **overrides) -> ActorLearner:
    return ActorLearner(tiny_model(seed), actor_config(**overrides), total_steps=10, device="cpu")


def test_update_without_old_logprobs_equals_recomputed_old_logprobs():
    # One epoch, one mini-batch of all 8 rows, 2 micro-batches: the update with old_logprobs
    # from a separate pass must equal the one that uses the detached current log-probs.
    batch = make_batch(seed=3)
    batch.pop("old_logprobs")
    with_pass, shortcut = _actor(ppo_mini_batch_size=8), _actor(ppo_mini_batch_size=8)
    recomputed = batch.union(with_pass.compute_logprobs(batch))
    metrics_pass = with_pass.update(recomputed)
    metrics_short = shortcut.update(batch)
    assert max_abs_diff(flat_params(with_pass.model), flat_params(shortcut.model)) < 1e-6
    assert metrics_short["grad_norm"] == pytest.approx(metrics_pass["grad_norm"], rel=1e-5)
    assert metrics_short["pg_clipfrac"] == 0.0  # ratio exactly 1: nothing clipped
    # and the step did change the weights (the test can fail)
    assert max_abs_diff(flat_params(tiny_model(0)), flat_params(shortcut.model)) > 1e-4


def test_shortcut_refused_when_not_on_policy():
    batch = make_batch(seed=3)
    batch.pop("old_logprobs")
    with pytest.raises(KeyError, match="only exact on-policy"):
        _actor(ppo_mini_batch_size=4).update(batch)  # 2 mini-batches: the second is off-policy
