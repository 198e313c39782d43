"""A hybrid model (tiny-hybrid: 3 Gated DeltaNet layers, 1 gated-attention layer) on the
engine's own path: K/V for the attention layer only, a conv and SSM state per slot for the
others (cache/kinds.py). In fp32 on CPU it samples what the slow path (the whole sequence
recomputed each step) and the model's own argmax give, with n samples copying the prompt's
state, preemption rebuilding it, kept turns and mixed steps continuing it; its log-probs
are the trainer's."""

from __future__ import annotations

import logging

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


@pytest.fixture(scope="module")
def hybrid():
    """tiny-hybrid with std-0.3 weights (fp32): peaked logits, greedy far from ties."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny-hybrid"), seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.3, generator=generator)
    return model


def _engine(model, slots=4, block=None, budget=None, per_step=0, seq=64, lag=0,
            cap=True) -> Engine:  # fmt: skip
    options = EngineOptions(**EAGER, kv_block_size=block, max_prefill_tokens_per_step=per_step,
                            sync_lag=lag, cap_state_slots=cap)  # fmt: skip
    return Engine(model, slots, seq, memory_budget=budget, options=options)


def _slow(engine, prompts, params, seeds=None):
    return generate_slow(engine, prompts, params, call_seeds(len(prompts), params, seeds))


def _assert_same(got, expected, atol=5e-5):
    """Tokens equal; log-probs within fp32 noise (the chunked delta rule of a prefill or of
    the slow path against the step-by-step recurrence of decode: ~1e-5 at 12 tokens)."""
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)


def _argmax_tokens(model, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_the_cache_keeps_kv_for_the_attention_layer_and_a_state_per_slot(hybrid):
    engine = _engine(hybrid, slots=3, block=16)
    assert engine.native and engine.slow_reason is None
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    cache, config = engine.cache, hybrid.config
    assert cache.keys.shape[0] == 1 and cache.kv_rows == [None, None, None, 0]
    conv_dim = 2 * 2 * 16 + 4 * 16
    assert cache.states.conv.shape == (3, 4, conv_dim, config.linear_conv_kernel_dim - 1)
    assert cache.states.ssm.shape == (3, 4, 4, 16, 16) and cache.states.ssm.dtype == torch.float32
    assert cache.nbytes() == 2 * cache.keys.nbytes + cache.states.nbytes()


def test_a_budget_counts_the_state_of_every_slot(hybrid):
    """Slot cache: a slot costs its K/V and its state; a budget of 3 such slots holds 2 and
    the scratch slot (K/V alone: 5); a paged cache whose budget the states
    take whole is refused by name."""
    probe = _engine(hybrid, slots=1)
    probe.generate([[1]], SamplingParams(max_new_tokens=1))
    kv = probe.cache.keys[:, 0].numel() * 4 * 2
    state = probe.cache.states.nbytes() // 2
    engine = _engine(hybrid, slots=8, budget=3 * (kv + state))
    assert 3 * (kv + state) // kv - 1 >= 5  # slots if the states were not counted
    assert engine.num_slots == 2
    with pytest.raises(ValueError, match="recurrent state"):
        _engine(hybrid, slots=8, block=16, budget=8 * state, cap=False).generate(
            [[1]], SamplingParams()
        )
    with pytest.raises(ValueError, match="no whole sequence of max_seq_len=64 beside its"):
        _engine(hybrid, slots=8, block=16, budget=2 * state).generate([[1]], SamplingParams())


def test_a_budget_of_n_whole_sequences_gets_n_slots(hybrid, caplog):
    """Paged, seq 96 (6 blocks of 16): a budget holding the states of 3 slots and the
    scratch one, and 3 sequences' blocks and the scratch block, gets 3 of max_batch_size=8
    slots, each able to grow to max_seq_len, logged once; a byte less, 2. Its 8 sequences
    wait for those slots (none preempted) and sample what 8 slots with room for all do.
    Pinned (cap=False), 4 slots' states leave blocks for 2 whole sequences (13 blocks)."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=5, ignore_eos=True)
    reference = _engine(hybrid, slots=8, block=16, seq=96)
    expected = reference.generate(PROMPTS, params)
    cache = reference.cache
    block = cache.keys[:, 0].numel() * cache.keys.element_size() * 2
    state = cache.states.nbytes() // 9  # 8 slots + the scratch one
    budget = 4 * state + (3 * 6 + 1) * block
    with caplog.at_level(logging.WARNING, logger="hybridflow.engine"):
        engine = _engine(hybrid, slots=8, block=16, seq=96, budget=budget)
        got = engine.generate(PROMPTS, params)
        engine.release()
        engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    assert engine.num_slots == 3 and engine.cache.num_blocks == 3 * 6
    assert engine.scheduler.paging.preemptions == 0
    _assert_same(got, expected)
    assert [r.getMessage() for r in caplog.records if r.name == "hybridflow.engine"] == [
        "engine: 3 slots of max_batch_size=8: the memory budget holds the per-sequence state "
        "and K/V blocks of 3 whole sequences of max_seq_len=96 "
        "(rollout.engine.cap_state_slots=false keeps them all)"
    ]
    assert _engine(hybrid, slots=8, block=16, seq=96, budget=budget - 1).num_slots == 2
    pinned = _engine(hybrid, slots=4, block=16, seq=96, budget=budget, cap=False)
    assert pinned.num_slots == 4 and pinned.cache.num_blocks // 6 == 2


@pytest.mark.parametrize("block", [None, 16])
def test_greedy_tokens_equal_the_slow_path_and_the_models_argmax(hybrid, block):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6, ignore_eos=True)
    engine = _engine(hybrid, block=block)
    got = engine.generate(PROMPTS, params)
    _assert_same(got, _slow(engine, PROMPTS, params))
    for i, prompt in enumerate(PROMPTS):
        assert got[2 * i].token_ids == _argmax_tokens(hybrid, prompt, 6)


def test_sampled_tokens_with_a_seed_equal_the_slow_path(hybrid):
    """n = 2 (each sample from the prompt's copied state), more requests than slots."""
    engine = _engine(hybrid, block=16)
    _assert_same(engine.generate(PROMPTS, SAMPLED), _slow(engine, PROMPTS, SAMPLED))


@pytest.mark.parametrize("block,per_step", [(None, 0), (16, 0), (16, 7)])
def test_n_samples_copy_the_prompts_state_once(hybrid, block, per_step):
    """n = 4: each prompt runs through prefill once (in chunks with per_step), then each of
    its 3 other samples takes the prompt's state in one copy from the prompt's slot (what
    they then sample: test_sampled_tokens_with_a_seed_equal_the_slow_path)."""
    params = SamplingParams(n=4, temperature=0.9, max_new_tokens=5, seed=2, ignore_eos=True)
    engine = _engine(hybrid, slots=8, block=block, per_step=per_step)
    engine.generate([[1]], SamplingParams(max_new_tokens=1))  # the cache, allocated
    states, copies = engine.cache.states, []
    copy = states.copy

    def recorded(src, dst):
        copies.extend(zip(src.tolist(), dst.tolist()))
        copy(src, dst)

    states.copy = recorded
    prompts = [PROMPTS[0], PROMPTS[3]]
    before = engine.prefill_tokens
    got = engine.generate(prompts, params)
    assert engine.prefill_tokens - before == sum(map(len, prompts))
    assert len(copies) == 2 * 3 and len({dst for _, dst in copies}) == 6
    assert len({src for src, _ in copies}) == 2  # one source slot a prompt
    assert len(got) == 8 and all(len(c.token_ids) == 5 for c in got)


@pytest.mark.parametrize("block", [None, 16])
def test_mixed_steps_sample_as_separate_passes(hybrid, block):
    """Prompts prefilled in chunks beside decoding rows (their states carried from chunk to
    chunk, the decode rows' moved one token) sample what separate passes do."""
    budgets = [12, 3, 9, 5, 12, 2, 7, 4]  # rows leave at different steps
    expected = _engine(hybrid, block=block).generate(PROMPTS, SAMPLED, max_new_tokens=budgets)
    engine = _engine(hybrid, block=block, per_step=5)
    _assert_same(engine.generate(PROMPTS, SAMPLED, max_new_tokens=budgets), expected)
    assert engine.scheduler.mixed_steps > 0


def test_logprobs_equal_the_trainers(hybrid):
    completions = _engine(hybrid).generate(PROMPTS, SAMPLED)
    for i, c in enumerate(completions):
        prompt = PROMPTS[i // 2]
        ids = torch.tensor(prompt + c.token_ids)
        cu = torch.tensor([0, len(ids)], dtype=torch.int32)
        hidden = hybrid.forward_packed(ids, torch.arange(len(ids)), cu, len(ids))
        start = len(prompt) - 1  # hidden at t predicts token t + 1
        expected, _ = logprobs_from_hidden(hidden[start : start + len(c.token_ids)],
                                           hybrid.lm_head.weight, torch.tensor(c.token_ids),
                                           temperature=0.9)  # fmt: skip
        assert (torch.tensor(c.logprobs) - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("per_step", [0, 9])
def test_preemption_rebuilds_the_state_by_prefill(hybrid, per_step):
    """14 blocks of 16 (and the slots' states) for 8 sequences growing to 2-4 blocks: the
    newest are preempted and prefilled again, and sample what an unpreempted run does.
    The slots pinned (cap=False): capped ones always have the blocks to finish."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=5, ignore_eos=True)
    reference = _engine(hybrid, slots=8, block=16, seq=96)
    expected = reference.generate(PROMPTS, params)
    cache = reference.cache
    block_bytes = cache.keys[:, 0].numel() * cache.keys.element_size() * 2
    states = cache.states.nbytes()  # 8 slots + the scratch one
    engine = _engine(hybrid, slots=8, block=16, seq=96, per_step=per_step,
                     budget=block_bytes * 15 + states, cap=False)  # fmt: skip
    got = engine.generate(PROMPTS, params)
    assert engine.cache.num_blocks == 14 and engine.scheduler.paging.preemptions > 0
    _assert_same(got, expected)


@pytest.mark.parametrize("per_step,slots", [(0, 8), (5, 3)])
def test_a_kept_turn_continues_the_state(hybrid, per_step, slots):
    """Turn two extends turn one's kept slots (only the new tokens run) and samples what a
    full prefill of the whole conversation samples. Turn one's rows end at different steps
    and are read back a chunk late (sync_lag=1, as on CUDA): finished rows step on, in
    decode chunks and (3 slots: the last prompt is prefilled beside decoding rows) in mixed
    steps, without moving their kept states."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    deltas = [[7, 8, 9], [11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [44, 45]]
    engine = _engine(hybrid, slots=slots, block=16, per_step=per_step, lag=1)
    first = engine.generate(PROMPTS[::-1], params, seeds=[1, 2, 3, 4], keep=True,
                            max_new_tokens=[5, 2, 6, 3])  # fmt: skip
    prompts = [p + c.token_ids + d for p, c, d in zip(PROMPTS[::-1], first, deltas)]
    before = engine.prefill_tokens
    second = engine.generate(prompts, params, seeds=[5, 6, 7, 8],
                             reuse=[c.kv_handle for c in first])  # fmt: skip
    continued = [len(d) + 1 for c, d in zip(first, deltas) if c.kv_handle is not None]
    assert len(continued) >= 2  # 3 slots: a kept one gives way to the fourth prompt
    assert engine.prefill_tokens - before <= sum(continued) + sum(map(len, prompts))
    if slots == 8:
        assert engine.prefill_tokens - before == sum(continued) and len(continued) == 4
    _assert_same(second, _slow(engine, prompts, params, seeds=[5, 6, 7, 8]))


def test_layers_without_their_cache_kind_run_the_slow_path_with_a_reason(monkeypatch):
    from hybridflow.engine.cache import kinds

    # an engine whose passes would not cover MLA's latent yet
    monkeypatch.setattr(kinds, "ENGINE_MIXERS", tuple(m for m in kinds.ENGINE_MIXERS if m != "mla"))
    model = build_model(preset_config("tiny-deepseek-v3"), seed=1).eval()
    engine = Engine(model, max_batch_size=2, max_seq_len=32)
    assert not engine.native and "latent" in engine.slow_reason


def test_the_rollout_service_keeps_only_exact_states(hybrid):
    """Requests through the service sample as alone; one stopping on an id only it has
    (checked by the host, the device stepping past it) keeps no slot, since its state moved
    on; the other's next turn continues its kept state and samples as a full prefill."""
    from hybridflow.engine.serving.service import RolloutService

    plain = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    alone = _engine(hybrid).generate([PROMPTS[0]], plain, seeds=[1])[0]
    stop = alone.token_ids[2]
    stopping = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True,
                              stop_token_ids=[stop])  # fmt: skip
    with RolloutService(_engine(hybrid, slots=4, block=16)) as service:
        a, b = service.submit_many([
            dict(prompt_ids=PROMPTS[0], params=stopping, seed=1, keep=True),
            dict(prompt_ids=PROMPTS[3], params=plain, seed=2, keep=True),
        ])  # fmt: skip
        first_a, first_b = a.result(timeout=60)[0], b.result(timeout=60)[0]
        assert first_a.token_ids == alone.token_ids[: alone.token_ids.index(stop) + 1]
        assert first_a.kv_handle is None and first_b.kv_handle is not None
        turn = PROMPTS[3] + first_b.token_ids + [9, 10]
        second = service.submit(turn, plain, seed=3, reuse=first_b.kv_handle).result(timeout=60)
    _assert_same(second, _slow(_engine(hybrid), [turn], plain, seeds=[3]))


def test_a_hybrid_mixture_of_experts_runs_natively_with_its_routes_recorded():
    """Qwen3.5-MoE's layers (routed experts and a gated shared expert) at tiny size: the
    slow path's tokens, log-probs and routing records."""
    config = preset_config("tiny-hybrid").replace(
        model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(2)
    model = build_model(config, seed=2).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    engine = _engine(model, block=16)
    assert engine.native and engine.moe
    got = engine.generate(PROMPTS[:2], SAMPLED)
    expected = _slow(engine, PROMPTS[:2], SAMPLED)
    _assert_same(got, expected)
    for a, b in zip(got, expected):
        assert a.routed_experts.shape == b.routed_experts.shape
        assert (a.routed_experts == b.routed_experts).all()
