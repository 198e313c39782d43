"""The forward-only passes (old log-probs, reference log-probs): their own token budget,
no autograd, and values that do not depend on how the rows are packed."""

import torch
from learner_helpers import actor_config, make_batch, tiny_model

from hybridflow.config import RefConfig
from hybridflow.learners import ActorLearner, RefPolicy
from hybridflow.learners.micro_batch import pack_by_token_budget

UPDATE_BUDGET = 11  # one full sequence: 6 prompt + 5 response tokens
LOG_PROB_BUDGET = 64


def _recording_forwards(policy):
    """Tokens of each forward of ``policy``, and whether autograd was on during it."""
    calls = []

    def record(module, args, output):
        calls.append((args[0].input_ids.numel(), torch.is_grad_enabled()))

    policy.register_forward_hook(record)
    return calls


def _actor(**cfg):
    config = actor_config(max_tokens_per_gpu=UPDATE_BUDGET, ppo_mini_batch_size=16, **cfg)
    return ActorLearner(tiny_model(), config, total_steps=1, device="cpu")


def test_old_log_probs_use_their_own_budget_and_match_the_update_budget_values():
    batch = make_batch(num_rows=16)
    lengths = batch["attention_mask"].sum(-1).tolist()
    small, large = _actor(), _actor(log_prob_max_tokens_per_gpu=LOG_PROB_BUDGET)
    small_calls, large_calls = _recording_forwards(small.policy), _recording_forwards(large.policy)
    small_out = small.compute_logprobs(batch, with_entropy=True)
    large_out = large.compute_logprobs(batch, with_entropy=True)
    assert len(small_calls) == len(pack_by_token_budget(lengths, UPDATE_BUDGET))
    assert len(large_calls) == len(pack_by_token_budget(lengths, LOG_PROB_BUDGET))
    assert len(large_calls) * 3 <= len(small_calls)  # 106 tokens: 2 forwards instead of 11
    assert max(tokens for tokens, _ in large_calls) > UPDATE_BUDGET
    assert not any(grad for _, grad in small_calls + large_calls)  # no autograd recorded
    for key in ("old_logprobs", "entropy"):  # fp32: packing must not change the values
        torch.testing.assert_close(large_out[key], small_out[key], rtol=0, atol=1e-6)
        assert not large_out[key].requires_grad and not large_out[key].is_inference()
    # the log-probs feed the update's loss (a tensor made under inference_mode could not)
    batch.tensors["old_logprobs"] = large_out["old_logprobs"]
    large_calls.clear()
    metrics = large.update(batch)
    assert metrics["pg_clipfrac"] == 0.0  # on-policy: the ratio is 1 everywhere
    assert max(tokens for tokens, _ in large_calls) <= UPDATE_BUDGET  # the update keeps its own


def test_reference_log_probs_do_not_depend_on_its_budget():
    batch = make_batch(num_rows=16, seed=1)
    outputs = []
    for budget in (UPDATE_BUDGET, LOG_PROB_BUDGET):
        ref = RefPolicy(tiny_model(), RefConfig(max_tokens_per_gpu=budget), device="cpu")
        calls = _recording_forwards(ref.policy)
        outputs.append(ref.compute_ref_logprobs(batch)["ref_logprobs"])
        lengths = batch["attention_mask"].sum(-1).tolist()
        assert len(calls) == len(pack_by_token_budget(lengths, budget))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-6)
