"""model.fused_logprob_head chooses the log-prob head of the actor's passes (old log-probs,
the update) and of the reference's; both heads give the same log-probs and entropy."""

import pytest
import torch
from learner_helpers import actor_config, make_batch, tiny_model

from hybridflow.config import ModelConfig, RefConfig
from hybridflow.learners import ActorLearner, RefPolicy


@pytest.fixture(scope="module")
def passes():
    batch = make_batch(seed=2)
    batch.meta["temperature"] = 0.8
    results = {}
    for fused in (True, False):
        actor = ActorLearner(tiny_model(), actor_config(), total_steps=2, device="cpu",
                             model_cfg=ModelConfig(path="tiny", fused_logprob_head=fused))  # fmt: skip
        reference = RefPolicy(tiny_model(), RefConfig(), device="cpu", fused_head=fused)
        results[fused] = (
            actor.policy.fused_head,
            reference.policy.fused_head,
            actor.compute_logprobs(batch, with_entropy=True),
            reference.compute_ref_logprobs(batch),
        )
    return results


def test_the_config_reaches_the_actor_and_the_reference(passes):
    assert passes[True][:2] == (True, True)
    assert passes[False][:2] == (False, False)


def test_both_heads_give_the_same_passes(passes):
    fused, chunked = passes[True], passes[False]
    for key in ("old_logprobs", "entropy"):
        torch.testing.assert_close(fused[2][key], chunked[2][key], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[3]["ref_logprobs"], chunked[3]["ref_logprobs"],
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    assert fused[2]["old_logprobs"].abs().sum() > 0
