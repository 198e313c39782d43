"""GPT-OSS (tiny-gpt-oss: a sliding layer of 8 tokens, then a full one, sinks in both,
biased experts) on the engine's own passes: a ring of the window's K/V per slot for the
sliding layer, K/V of every position for the full one (cache/window.py, kinds.py). With
prompts and responses longer than the window, in fp32 on CPU it samples what the slow path
(the whole sequence recomputed each step) and the model's own argmax give: n samples
copying the prompt's ring, preemption rebuilding it, kept turns and mixed steps continuing
it; routes recorded as the slow path records them; log-probs the trainer's."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.sampling import call_seeds
from hybridflow.engine.slow import generate_slow
from hybridflow.models.heads.logprobs import logprobs_from_hidden
from tests.engine.gpt_oss_helpers import gpt_oss_model

EAGER = dict(decode_backend="torch", cuda_graphs=False, steps_per_sync=2)
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [12], [100, 3, 8, 19, 23, 60, 61]]
SAMPLED = SamplingParams(n=2, temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def gpt_oss():
    return gpt_oss_model()


def _engine(model, slots=4, block=None, budget=None, per_step=0, seq=64, lag=0,
            cap=True) -> Engine:  # fmt: skip
    options = EngineOptions(**EAGER, kv_block_size=block, max_prefill_tokens_per_step=per_step,
                            sync_lag=lag, cap_state_slots=cap)  # fmt: skip
    return Engine(model, slots, seq, memory_budget=budget, options=options)


def _slow(engine, prompts, params, seeds=None):
    return generate_slow(engine, prompts, params, call_seeds(len(prompts), params, seeds))


def _assert_same(got, expected, atol=1e-5):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)


def _argmax_tokens(model, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_the_cache_keeps_a_ring_for_the_sliding_layer_and_kv_for_the_full_one(gpt_oss):
    engine = _engine(gpt_oss, slots=3, block=16)
    assert engine.native and engine.slow_reason is None and engine.moe
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    cache = engine.cache
    assert cache.keys.shape[0] == 1 and cache.kv_rows == [None, 0]
    assert cache.window.keys.shape == (1, 4, 8, 2, 16)  # 3 slots + scratch, 8 positions
    assert cache.nbytes() == 2 * cache.keys.nbytes + cache.routes.nbytes + cache.window.nbytes()


def test_a_budget_counts_the_ring_of_every_slot(gpt_oss):
    """Slot cache: a slot costs its full layer's K/V (and routes) and its ring; a budget of
    3 such slots holds 2 and the scratch slot; a paged cache whose budget the rings take
    whole is refused by name."""
    probe = _engine(gpt_oss, slots=1)
    probe.generate([[1]], SamplingParams(max_new_tokens=1))
    cache = probe.cache
    slot = (cache.keys.nbytes + cache.values.nbytes + cache.routes.nbytes) // 2
    ring = cache.window.nbytes() // 2
    engine = _engine(gpt_oss, slots=8, budget=3 * (slot + ring))
    assert engine.num_slots == 2
    with pytest.raises(ValueError, match="sliding-window ring"):
        _engine(gpt_oss, slots=8, block=16, budget=8 * ring, cap=False).generate(
            [[1]], SamplingParams()
        )
    with pytest.raises(ValueError, match="no whole sequence of max_seq_len=64 beside its"):
        _engine(gpt_oss, slots=8, block=16, budget=2 * ring).generate([[1]], SamplingParams())


def test_a_budget_of_n_whole_sequences_gets_n_slots(gpt_oss):
    """Paged, seq 64 (4 blocks of 16): a budget holding 3 rings (2 slots and the scratch
    one) and 2 sequences' blocks and the scratch block gets 2 of max_batch_size=8 slots;
    its 8 sequences wait for them (none preempted) and sample what 8 slots do."""
    reference = _engine(gpt_oss, slots=8, block=16)
    expected = reference.generate(PROMPTS, SAMPLED)
    cache = reference.cache
    block = cache.keys[:, 0].nbytes + cache.values[:, 0].nbytes + cache.routes[0].nbytes
    ring = cache.window.nbytes() // 9  # 8 slots + the scratch one
    engine = _engine(gpt_oss, slots=8, block=16, budget=3 * ring + (2 * 4 + 1) * block)
    got = engine.generate(PROMPTS, SAMPLED)
    assert engine.num_slots == 2 and engine.cache.num_blocks == 2 * 4
    assert engine.scheduler.paging.preemptions == 0
    _assert_same(got, expected)


@pytest.mark.parametrize("block", [None, 16])
def test_greedy_tokens_equal_the_slow_path_and_the_models_argmax(gpt_oss, block):
    """18 + 10 tokens against a window of 8: the ring wraps in prefill and in decode."""
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10, ignore_eos=True)
    engine = _engine(gpt_oss, block=block)
    got = engine.generate(PROMPTS, params)
    _assert_same(got, _slow(engine, PROMPTS, params))
    for i, prompt in enumerate(PROMPTS):
        assert got[2 * i].token_ids == _argmax_tokens(gpt_oss, prompt, 10)


def test_sampled_tokens_with_a_seed_equal_the_slow_path_with_routes(gpt_oss):
    """n = 2 (each sample from the prompt's copied ring), more requests than slots; each
    completion's routing record is the slow path's."""
    engine = _engine(gpt_oss, block=16)
    got, expected = engine.generate(PROMPTS, SAMPLED), _slow(engine, PROMPTS, SAMPLED)
    _assert_same(got, expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        positions = len(PROMPTS[i // 2]) + len(a.token_ids) - 1  # [positions, layers, k]
        assert a.routed_experts.shape == b.routed_experts.shape == (positions, 2, 2)
        assert (a.routed_experts == b.routed_experts).all()


@pytest.mark.parametrize("block", [None, 16])
def test_mixed_steps_sample_as_separate_passes(gpt_oss, block):
    """Prompts prefilled in chunks beside decoding rows (the chunks attending over the ring
    the previous chunk left) sample what separate passes do."""
    budgets = [12, 3, 9, 5, 12, 2, 7, 4]  # rows leave at different steps
    expected = _engine(gpt_oss, block=block).generate(PROMPTS, SAMPLED, max_new_tokens=budgets)
    engine = _engine(gpt_oss, block=block, per_step=5)
    _assert_same(engine.generate(PROMPTS, SAMPLED, max_new_tokens=budgets), expected)
    assert engine.scheduler.mixed_steps > 0


def test_logprobs_equal_the_trainers(gpt_oss):
    completions = _engine(gpt_oss).generate(PROMPTS, SAMPLED)
    for i, c in enumerate(completions):
        prompt = PROMPTS[i // 2]
        ids = torch.tensor(prompt + c.token_ids)
        cu = torch.tensor([0, len(ids)], dtype=torch.int32)
        hidden = gpt_oss.forward_packed(ids, torch.arange(len(ids)), cu, len(ids))
        start = len(prompt) - 1  # hidden at t predicts token t + 1
        expected, _ = logprobs_from_hidden(hidden[start : start + len(c.token_ids)],
                                           gpt_oss.lm_head.weight, torch.tensor(c.token_ids),
                                           temperature=0.9)  # fmt: skip
        assert (torch.tensor(c.logprobs) - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("per_step", [0, 9])
def test_preemption_rebuilds_the_ring_by_prefill(gpt_oss, per_step):
    """14 blocks of 16 (and the slots' rings) for 8 sequences growing to 2-4 blocks: the
    newest are preempted and prefilled again, and sample what an unpreempted run does.
    The slots pinned (cap=False): capped ones always have the blocks to finish."""
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=5, ignore_eos=True)
    reference = _engine(gpt_oss, slots=8, block=16, seq=96)
    expected = reference.generate(PROMPTS, params)
    cache = reference.cache
    block_bytes = cache.keys[:, 0].nbytes + cache.values[:, 0].nbytes + cache.routes[0].nbytes
    engine = _engine(gpt_oss, slots=8, block=16, seq=96, per_step=per_step,
                     budget=block_bytes * 15 + cache.window.nbytes(), cap=False)  # fmt: skip
    got = engine.generate(PROMPTS, params)
    assert engine.cache.num_blocks == 14 and engine.scheduler.paging.preemptions > 0
    _assert_same(got, expected)


@pytest.mark.parametrize("per_step,slots", [(0, 8), (5, 3)])
def test_a_kept_turn_continues_the_ring(gpt_oss, per_step, slots):
    """Turn two extends turn one's kept slots (only the new tokens run, over the ring turn
    one left) and samples what a full prefill of the whole conversation samples. Turn one's
    rows end at different steps and are read back a chunk late (sync_lag=1, as on CUDA):
    finished rows step on without moving their kept rings."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    deltas = [[7, 8, 9], [11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [44, 45]]
    engine = _engine(gpt_oss, slots=slots, block=16, per_step=per_step, lag=1)
    first = engine.generate(PROMPTS[::-1], params, seeds=[1, 2, 3, 4], keep=True,
                            max_new_tokens=[5, 2, 6, 3])  # fmt: skip
    prompts = [p + c.token_ids + d for p, c, d in zip(PROMPTS[::-1], first, deltas)]
    before = engine.prefill_tokens
    second = engine.generate(prompts, params, seeds=[5, 6, 7, 8],
                             reuse=[c.kv_handle for c in first])  # fmt: skip
    continued = [len(d) + 1 for c, d in zip(first, deltas) if c.kv_handle is not None]
    assert len(continued) >= 2
    if slots == 8:
        assert engine.prefill_tokens - before == sum(continued) and len(continued) == 4
    _assert_same(second, _slow(engine, prompts, params, seeds=[5, 6, 7, 8]))


def test_the_rollout_service_keeps_only_exact_rings(gpt_oss):
    """A request stopping on an id only it has (checked by the host, the device stepping
    past it, its ring moving on over positions the next turn needs) keeps no slot; the
    other's next turn continues its kept ring and samples as a full prefill."""
    from hybridflow.engine.serving.service import RolloutService

    plain = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    alone = _engine(gpt_oss).generate([PROMPTS[0]], plain, seeds=[1])[0]
    stop = alone.token_ids[2]
    stopping = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True,
                              stop_token_ids=[stop])  # fmt: skip
    with RolloutService(_engine(gpt_oss, slots=4, block=16)) as service:
        a, b = service.submit_many([
            dict(prompt_ids=PROMPTS[0], params=stopping, seed=1, keep=True),
            dict(prompt_ids=PROMPTS[3], params=plain, seed=2, keep=True),
        ])  # fmt: skip
        first_a, first_b = a.result(timeout=60)[0], b.result(timeout=60)[0]
        assert first_a.token_ids == alone.token_ids[: alone.token_ids.index(stop) + 1]
        assert first_a.kv_handle is None and first_b.kv_handle is not None
        turn = PROMPTS[3] + first_b.token_ids + [9, 10]
        second = service.submit(turn, plain, seed=3, reuse=first_b.kv_handle).result(timeout=60)
    _assert_same(second, _slow(_engine(gpt_oss), [turn], plain, seeds=[3]))


@pytest.mark.parametrize("window,block,per_step", [(2**31 - 1, None, 0), (2**31 - 1, 16, 5),
                                                   (10**6, 16, 0)])  # fmt: skip
def test_a_window_past_max_seq_len_decodes_as_a_window_of_max_seq_len(window, block, per_step):
    """A sliding layer whose window no sequence of max_seq_len=64 fills keeps a ring of 64
    (cache/window.ring_length: the cache of a 64-token window, not 2**31 - 1 positions a
    slot) and samples, greedy in fp32, what the window of 64 does and what the model
    (which attends over the whole window) gives; chunked prompts (per_step) extend over it."""
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10, ignore_eos=True)
    wide, as_long = gpt_oss_model(window=window), gpt_oss_model(window=64)
    reference = _engine(as_long, block=block, per_step=per_step)
    expected = reference.generate(PROMPTS, params)
    engine = _engine(wide, block=block, per_step=per_step)
    got = engine.generate(PROMPTS, params)
    _assert_same(got, expected)
    _assert_same(got, _slow(engine, PROMPTS, params))
    assert engine.cache.window.keys.shape == reference.cache.window.keys.shape == (1, 5, 64, 2, 16)
    assert engine.cache.nbytes() == reference.cache.nbytes()
