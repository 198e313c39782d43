"""DeepSeek-V3 (tiny-deepseek-v3: MLA in every layer, a dense first layer, grouped-routed
and shared experts) on the engine's own passes: the cache keeps each MLA layer's latent
(kv_lora_rank + qk_rope_head_dim a position) instead of K/V, paged and counted in the
budget; prefill runs the expanded form, decode and extend the absorbed one. In fp32 on CPU
it samples what the slow path (the whole sequence recomputed each step) and the model's own
argmax give, routes recorded as the slow path records them, with n samples sharing a
prompt's blocks, preemption, mixed steps and kept turns; its log-probs are the trainer's."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.sampling import call_seeds
from hybridflow.engine.slow import generate_slow
from hybridflow.models import build_model
from hybridflow.models.heads.logprobs import logprobs_from_hidden
from hybridflow.models.presets import preset_config

EAGER = dict(decode_backend="torch", cuda_graphs=False, steps_per_sync=2)
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [12], [100, 3, 8, 19, 23, 60, 61]]
SAMPLED = SamplingParams(n=2, temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True)
WIDTH = 32 + 8  # tiny-deepseek-v3's kv_lora_rank + qk_rope_head_dim


@pytest.fixture(scope="module")
def deepseek():
    """tiny-deepseek-v3 with std-0.3 weights (fp32): peaked logits, greedy far from ties."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny-deepseek-v3"), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def _engine(model, slots=4, block=None, budget=None, per_step=0, seq=64, lag=0) -> Engine:
    options = EngineOptions(**EAGER, kv_block_size=block, max_prefill_tokens_per_step=per_step,
                            sync_lag=lag)  # fmt: skip
    return Engine(model, slots, seq, memory_budget=budget, options=options)


def _slow(engine, prompts, params, seeds=None):
    return generate_slow(engine, prompts, params, call_seeds(len(prompts), params, seeds))


def _assert_same(got, expected, atol=2e-5, routes=True):
    """Tokens equal, log-probs within fp32 noise (the absorbed form against the expanded
    one), the routing records equal."""
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)
        if routes:
            assert a.routed_experts.shape == b.routed_experts.shape
            assert (a.routed_experts == b.routed_experts).all()


def _argmax_tokens(model, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_the_cache_keeps_the_latent_not_kv(deepseek):
    engine = _engine(deepseek, slots=3, block=16)
    assert engine.native and engine.slow_reason is None and engine.moe
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    cache = engine.cache
    assert cache.keys.shape[0] == 0 and cache.states is None
    assert cache.latent.shape == (3, cache.num_blocks + 1, 16, WIDTH)
    assert cache.latent_rows == [0, 1, 2]
    latent = cache.latent.numel() * 4
    assert cache.nbytes() == latent + cache.routes.numel() * cache.routes.element_size()


def test_the_budget_counts_latent_bytes(deepseek):
    """A paged cache's block costs its latent (3 layers x 40 values) and routing record, not
    K/V of the config's 2 kv heads x 8: a budget of 10 such blocks holds 9 and the scratch."""
    block = 3 * WIDTH * 4 * 16 + 16 * 2 * 2  # fp32 latent + uint8 routes (2 layers x top-2)
    engine = _engine(deepseek, slots=4, block=16, budget=10 * block)
    engine.generate([[1]], SamplingParams(max_new_tokens=1))
    assert engine.cache.num_blocks == 9
    assert engine.cache.nbytes() == 10 * block
    # the plan's bytes a token are the engine's (memory_rollout.kv_slot_bytes reads them)
    assert deepseek.config.kv_bytes_per_token(4) == 3 * WIDTH * 4


@pytest.mark.parametrize("block", [None, 16])
def test_greedy_tokens_equal_the_slow_path_and_the_models_argmax(deepseek, block):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6, ignore_eos=True)
    engine = _engine(deepseek, block=block)
    got = engine.generate(PROMPTS, params)
    _assert_same(got, _slow(engine, PROMPTS, params))
    for i, prompt in enumerate(PROMPTS):
        assert got[2 * i].token_ids == _argmax_tokens(deepseek, prompt, 6)


def test_sampled_tokens_with_a_seed_equal_the_slow_path(deepseek):
    """n = 2 (each sample reading its prompt's shared blocks), more requests than slots."""
    engine = _engine(deepseek, block=16)
    _assert_same(engine.generate(PROMPTS, SAMPLED), _slow(engine, PROMPTS, SAMPLED))


def test_mixed_steps_sample_as_separate_passes(deepseek):
    """Prompts prefilled in chunks beside decoding rows (a chunk's tokens attending to the
    latents the chunks before wrote) sample what separate passes do."""
    budgets = [12, 3, 9, 5, 12, 2, 7, 4]
    expected = _engine(deepseek, block=16).generate(PROMPTS, SAMPLED, max_new_tokens=budgets)
    engine = _engine(deepseek, block=16, per_step=5)
    _assert_same(engine.generate(PROMPTS, SAMPLED, max_new_tokens=budgets), expected)
    assert engine.scheduler.mixed_steps > 0


def test_logprobs_equal_the_trainers(deepseek):
    completions = _engine(deepseek).generate(PROMPTS[:2], SAMPLED)
    for i, c in enumerate(completions):
        prompt = PROMPTS[i // 2]
        ids = torch.tensor(prompt + c.token_ids)
        cu = torch.tensor([0, len(ids)], dtype=torch.int32)
        hidden = deepseek.forward_packed(ids, torch.arange(len(ids)), cu, len(ids))
        start = len(prompt) - 1  # hidden at t predicts token t + 1
        expected, _ = logprobs_from_hidden(hidden[start : start + len(c.token_ids)],
                                           deepseek.lm_head.weight, torch.tensor(c.token_ids),
                                           temperature=0.9)  # fmt: skip
        assert (torch.tensor(c.logprobs) - expected).abs().max().item() <= 2e-5


def test_preemption_recomputes_the_latent(deepseek):
    """14 blocks of 16 for 8 sequences growing to 2-4 blocks: the newest are preempted and
    prefilled again, and sample what an unpreempted run does."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=5, ignore_eos=True)
    reference = _engine(deepseek, slots=8, block=16, seq=96)
    expected = reference.generate(PROMPTS, params)
    block_bytes = reference.cache.nbytes() // (reference.cache.num_blocks + 1)
    engine = _engine(deepseek, slots=8, block=16, seq=96, budget=block_bytes * 15)
    got = engine.generate(PROMPTS, params)
    assert engine.cache.num_blocks == 14 and engine.scheduler.paging.preemptions > 0
    _assert_same(got, expected)


def test_a_kept_turn_extends_the_latent(deepseek):
    """Turn two extends turn one's kept slots (only the new tokens run, absorbed over the
    kept latents) and samples what a full pass over the whole conversation samples."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    deltas = [[7, 8, 9], [11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [44, 45]]
    engine = _engine(deepseek, slots=8, block=16)
    first = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4], keep=True)
    prompts = [p + c.token_ids + d for p, c, d in zip(PROMPTS, first, deltas)]
    before = engine.prefill_tokens
    second = engine.generate(prompts, params, seeds=[5, 6, 7, 8],
                             reuse=[c.kv_handle for c in first])  # fmt: skip
    assert engine.prefill_tokens - before == sum(len(d) + 1 for d in deltas)
    _assert_same(second, _slow(engine, prompts, params, seeds=[5, 6, 7, 8]), routes=False)


def test_samples_share_the_prompts_latent_blocks(deepseek):
    """4 samples of an 18-token prompt growing to 28 tokens: 2 blocks each alone (8), but the
    prompt's full block is shared, its partial one copied (1 + 4). A budget of 5 blocks
    decodes them all together, unpreempted, sampling what the slow path samples."""
    params = SamplingParams(n=4, temperature=0.9, max_new_tokens=10, seed=7, ignore_eos=True)
    probe = _engine(deepseek, slots=4, block=16, seq=32)
    probe.generate([[1]], SamplingParams(max_new_tokens=1))
    block_bytes = probe.cache.nbytes() // (probe.cache.num_blocks + 1)
    engine = _engine(deepseek, slots=4, block=16, seq=32, budget=6 * block_bytes)
    got = engine.generate(PROMPTS[:1], params)
    assert engine.cache.num_blocks == 5 and engine.scheduler.paging.preemptions == 0
    assert engine.scheduler.decoded_rows == 4 * engine.scheduler.decode_steps
    _assert_same(got, _slow(engine, PROMPTS[:1], params))


def test_unmerged_lora_adapters_decode_as_the_slow_path(deepseek):
    """LoRA on q/k/v/o (MLA: q_a/q_b, kv_a and kv_b, o_proj) decoded unmerged: the absorbed
    decode reads kv_b_proj's base weight plus its adapter's product."""
    import copy

    pytest.importorskip("peft")
    from hybridflow.engine.adapters import adapter_layers
    from hybridflow.learners.lora import apply_lora

    model = copy.deepcopy(deepseek)
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    generator = torch.Generator().manual_seed(4)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # trained adapters: B is no longer 0
            p.data.normal_(0, 0.2, generator=generator)
    model.requires_grad_(False)
    assert any("kv_b_proj" in name for name, _ in model.named_modules()
               if _ in adapter_layers(model))  # fmt: skip
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6, ignore_eos=True)
    engine = _engine(model, block=16)
    got = engine.generate(PROMPTS[:2], params)
    _assert_same(got, _slow(engine, PROMPTS[:2], params))
    assert [c.token_ids for c in got] != [c.token_ids for c in _engine(deepseek).generate(
        PROMPTS[:2], params)]  # fmt: skip


def test_deepseek_v2_layers_run_natively_with_their_routes_recorded():
    """DeepSeek-V2's softmax router with group-limited top-k (no correction bias, weights not
    renormalised) beside the same MLA: the slow path's tokens and routing records."""
    config = preset_config("tiny-deepseek-v3").replace(
        model_type="deepseek_v2", topk_method="group_limited_greedy", norm_topk_prob=False
    )
    generator = torch.Generator().manual_seed(2)
    model = build_model(config, seed=2).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    engine = _engine(model, block=16)
    assert engine.native
    _assert_same(engine.generate(PROMPTS[:2], SAMPLED), _slow(engine, PROMPTS[:2], SAMPLED))
