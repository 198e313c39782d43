import math

import pytest
import torch
from learner_helpers import actor_config, flat_params, make_batch, max_abs_diff, tiny_model

from hybridflow.learners import ActorLearner
from hybridflow.protocol import Batch


def _actor(model=None, total_steps=4, **cfg):
    return ActorLearner(
        model or tiny_model(), actor_config(**cfg), total_steps=total_steps, device="cpu"
    )


def test_compute_logprobs_match_padded_forward_with_temperature():
    batch = make_batch(seed=1)
    batch.meta["temperature"] = 0.7
    actor = _actor(max_tokens_per_gpu=24)  # token-budget packing for inference too
    out = actor.compute_logprobs(batch, with_entropy=True)
    model = tiny_model()
    P = batch["prompts"].shape[1]
    with torch.no_grad():
        logits = model(
            torch.cat([batch["prompts"], batch["responses"]], 1), batch["attention_mask"]
        )
        logp_all = torch.log_softmax(logits[:, P - 1 : -1] / 0.7, -1)
        ref = logp_all.gather(-1, batch["responses"][..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    mask = batch["response_mask"]
    torch.testing.assert_close(out["old_logprobs"], ref * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["entropy"], entropy * mask, atol=1e-5, rtol=1e-5)


def _record_gradients(actor):
    """Snapshot the accumulated gradients just before each optimizer step."""
    recorded = []
    step = actor.core.optimizer_step

    def recording_step(grad_clip):
        recorded.append(
            {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
        )
        return step(grad_clip)

    actor.core.optimizer_step = recording_step
    return recorded


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_does_not_change_the_update(agg):
    batch = make_batch(seed=2)
    common = dict(loss_agg_mode=agg, entropy_coeff=0.01, use_kl_loss=True)
    reference = _actor(micro_batch_size_per_gpu=4, **common)
    ref_grads = _record_gradients(reference)
    ref_metrics = reference.update(batch)
    ref_weights = flat_params(reference.model)
    for variant in ({"micro_batch_size_per_gpu": 1}, {"max_tokens_per_gpu": 12}):
        actor = _actor(**common, **variant)
        grads = _record_gradients(actor)
        metrics = actor.update(batch)
        assert len(grads) == len(ref_grads) == 2  # two mini-batches of 4
        for got, want in zip(grads, ref_grads):
            # fp32 sums in another order: equal up to rounding (largest grads are ~1e-1).
            assert max_abs_diff(got, want) < 1e-6, variant
        # Adam's first step is ~lr * sign(g): rounding on coordinates whose gradient is ~0
        # can move them by up to lr * 1e-2, so weights get a looser bound than gradients.
        assert max_abs_diff(flat_params(actor.model), ref_weights) < 2e-2 * actor.cfg.lr
        for key in ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
    assert ref_metrics["grad_norm"] > 0 and ref_metrics["pg_clipfrac"] > 0
    assert max_abs_diff(ref_weights, flat_params(tiny_model())) > 1e-3  # it did train


def test_update_equals_one_big_batch_gradient():
    # Two mini-batches of 4 with micro-batches of 1 vs. a literal computation of the first
    # mini-batch's loss on the whole mini-batch at once (plain autograd, no learner).
    batch = make_batch(seed=4)
    actor = _actor(micro_batch_size_per_gpu=1, ppo_mini_batch_size=4, grad_clip=0.0, lr=1e-3)
    model = tiny_model()
    first = batch.index(list(range(4)))
    from hybridflow.algos import policy_loss
    from hybridflow.learners.modules import PolicyModel
    from hybridflow.learners.packing import pack_rows

    packed = pack_rows(first["prompts"], first["responses"], first["attention_mask"])
    logprobs = packed.scatter(PolicyModel(model)(packed)[0])
    loss, _ = policy_loss(
        "vanilla",
        old_logprobs=first["old_logprobs"],
        logprobs=logprobs,
        advantages=first["advantages"],
        response_mask=first["response_mask"],
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    loss.backward()
    expected_norm = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters()))
    actor.cfg.ppo_mini_batch_size = 8  # one optimizer step over the first 4 rows only
    metrics = actor.update(first)
    assert metrics["pg_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-5)


def test_nan_gradient_skips_the_step_and_keeps_weights():
    batch = make_batch(seed=5)
    actor = _actor(ppo_mini_batch_size=8, micro_batch_size_per_gpu=4)
    before = flat_params(actor.model)
    poisoned = batch.index(list(range(len(batch))))
    advantages = poisoned["advantages"].clone()
    advantages[6, 0] = float("nan")  # inside the mask of the second micro-batch
    poisoned.tensors["advantages"] = advantages
    metrics = actor.update(poisoned)
    assert metrics["skipped_steps"] == 1.0
    assert max_abs_diff(flat_params(actor.model), before) == 0.0
    assert all(p.grad is None for p in actor.model.parameters())
    assert not actor.core.optimizer.state  # AdamW moments untouched
    metrics = actor.update(batch)  # recovers on the next finite batch
    assert metrics["skipped_steps"] == 0.0 and actor.total_skipped_steps == 1
    assert max_abs_diff(flat_params(actor.model), before) > 0


def test_save_load_continue_equals_continue(tmp_path):
    first, second = make_batch(seed=6), make_batch(seed=7)
    cfg = dict(lr_scheduler="cosine", lr_warmup_steps=1, shuffle=True, ppo_mini_batch_size=4)
    actor = _actor(**cfg)
    actor.update(first)
    actor.save(tmp_path / "ckpt")
    expected_metrics = actor.update(second)
    expected = flat_params(actor.model)
    resumed = _actor(model=tiny_model(seed=123), **cfg)  # different weights before the load
    resumed.load(tmp_path / "ckpt")
    assert resumed.update_count == 1
    metrics = resumed.update(second)
    assert max_abs_diff(flat_params(resumed.model), expected) == 0.0  # bit-exact
    assert metrics == expected_metrics


def test_batch_contract_errors_and_output_keys():
    actor = _actor()
    batch = make_batch()
    out = actor.compute_logprobs(batch)
    assert isinstance(out, Batch) and out.keys() == ["old_logprobs"]
    with pytest.raises(KeyError, match="advantages"):
        actor.update(
            batch.select("prompts", "responses", "attention_mask", "response_mask", "old_logprobs")
        )
    with pytest.raises(ValueError, match="mini-batch"):
        _actor(ppo_mini_batch_size=3).update(batch)


def test_hf_weights_stream_is_zero_copy_on_one_device():
    actor = _actor()
    params = dict(actor.model.named_parameters())
    names = []
    for name, tensor in actor.hf_weights():
        names.append(name)
        assert tensor.data_ptr() == params[name].data_ptr()  # the parameter itself
    # HF layout, tied lm_head omitted (the tiny preset ties embeddings)
    assert names == [n for n in tiny_model().state_dict() if n != "lm_head.weight"]


def test_lr_schedule_counts_optimizer_steps():
    # 2 RL steps x 2 mini-batches = 4 optimizer steps; warm-up 2, then linear decay to 0.
    # Step i uses lr * f(i): f(0) = 1/3, f(1) = 2/3, f(2) = 1, f(3) = 1 - (3 - 2) / 2 = 0.5.
    actor = _actor(total_steps=2, lr_scheduler="linear", lr_warmup_steps=2, lr=0.3)
    batch = make_batch(seed=8)
    assert actor.update(batch)["lr"] == pytest.approx(0.3 * 2 / 3)
    assert actor.update(batch)["lr"] == pytest.approx(0.3 * 0.5)


def test_padding_micro_batches_for_other_ranks_change_nothing():
    # Under FSDP every rank must run as many micro-batches as the busiest one; a rank with
    # fewer rows runs empty ones (one row, loss weight 0). Simulate "another rank needs 6".
    batch = make_batch(seed=9)
    reference = _actor(max_tokens_per_gpu=64, ppo_mini_batch_size=8)
    ref_grads = _record_gradients(reference)
    ref_logprobs = reference.compute_logprobs(batch)["old_logprobs"]
    ref_metrics = reference.update(batch)
    padded = _actor(max_tokens_per_gpu=64, ppo_mini_batch_size=8)
    real_all_reduce = padded.core.all_reduce

    def busier_peer(tensor, op="sum"):
        return tensor.fill_(10) if op == "max" else real_all_reduce(tensor, op)

    padded.core.all_reduce = busier_peer
    plan = padded.core.plan_micro_batches(batch["attention_mask"], 8, 64)
    assert len(plan) == 10 and sum(1 for rows in plan if not rows) == 2  # 8 rows, 10 slots
    grads = _record_gradients(padded)
    torch.testing.assert_close(padded.compute_logprobs(batch)["old_logprobs"], ref_logprobs)
    metrics = padded.update(batch)
    assert max_abs_diff(grads[0], ref_grads[0]) < 1e-6
    for key in ("pg_loss", "pg_clipfrac", "grad_norm"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5), key


def test_importance_weights_use_each_tokens_behaviour_logprob():
    """A partial rollout's sample: its first two tokens were sampled by an older policy
    (ratio old/behaviour = 4, capped at 2), the rest by the newer one (ratio 1.5). The update
    weights each token by its own ratio: mean = (2 * n_old + 1.5 * n_new) / n, capped
    fraction = n_old / n (one mini-batch, one micro-batch: the exact token means)."""
    batch = make_batch(num_rows=4)
    mask = batch.tensors["response_mask"]
    older = torch.zeros_like(mask)
    older[:, :2] = 1.0  # token_versions [v, v, v+1, v+1, ...]
    older = older * mask
    log_ratio = older * math.log(4.0) + (mask - older) * math.log(1.5)
    batch.tensors["rollout_logprobs"] = batch.tensors["old_logprobs"] - log_ratio
    metrics = _actor(rollout_is_cap=2.0).update(batch)
    n_old, n = float(older.sum()), float(mask.sum())
    assert metrics["rollout_is/mean"] == pytest.approx((2 * n_old + 1.5 * (n - n_old)) / n)
    assert metrics["rollout_is/capped_frac"] == pytest.approx(n_old / n)


def test_an_unresolved_auto_budget_trains_with_the_unplanned_one():
    """actor.max_tokens_per_gpu=auto is resolved at run start; a learner built without that
    (library use) packs by the budget a run with no GPU size gets, and trains."""
    from hybridflow.config.sections import UNPLANNED_UPDATE_BUDGET

    actor = _actor(max_tokens_per_gpu="auto")
    assert actor.cfg.max_tokens_per_gpu == UNPLANNED_UPDATE_BUDGET
    before = flat_params(actor.model)
    metrics = actor.update(make_batch(seed=2))
    assert all(math.isfinite(v) for v in metrics.values())
    assert max_abs_diff(flat_params(actor.model), before) > 0
