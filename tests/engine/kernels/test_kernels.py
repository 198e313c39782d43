"""Triton kernels against their torch references, and the whole fast decode path against the
eager one. Runs on CUDA (marked gpu), or on CPU under TRITON_INTERPRET=1 when triton is
installed (make test runs them so); skipped otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.kernels import attention, rowwise, sampler
from hybridflow.engine.layers.eager import cached_attention_torch
from hybridflow.engine.sampling import request_seeds, sample_reference, split_seed  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402
from hybridflow.models.rope import apply_rope, rope_cos_sin  # noqa: E402


def _cache_like(slots, seq, kv_heads, dim, fill=torch.zeros):
    """A one-layer cache [slots, seq, kv_heads, dim]."""
    return fill(slots, seq, kv_heads, dim, device=DEVICE)


class _Norm:
    def __init__(self, dim):
        self.weight = torch.randn(dim, device=DEVICE)
        self.eps = 1e-6


def test_rms_norms_and_silu_match_torch():
    x, d = torch.randn(5, 96, device=DEVICE), torch.randn(5, 96, device=DEVICE)
    norm = _Norm(96)
    expected = F.rms_norm(x + d, (96,), norm.weight, norm.eps)
    residual = x.clone()
    torch.testing.assert_close(rowwise.add_rms_norm(residual, d, norm), expected)
    torch.testing.assert_close(residual, x + d)
    torch.testing.assert_close(rowwise.rms_norm(x, norm), F.rms_norm(x, (96,), norm.weight, 1e-6))
    unweighted = rowwise.rms_norm(x, norm, weighted=False)
    torch.testing.assert_close(unweighted, F.rms_norm(x, (96,), None, 1e-6))
    gate_up = torch.randn(3, 400, device=DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)  # strided halves, as with fused gate/up weights
    torch.testing.assert_close(rowwise.silu_mul(gate, up), F.silu(gate) * up)
    interleaved = torch.stack([gate, up], dim=-1).flatten(1)  # gate_0, up_0, gate_1, ...
    torch.testing.assert_close(rowwise.silu_mul_pairs(interleaved), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_a_zero_centered_norm_scales_by_one_plus_its_weight(dtype):
    """Qwen3.5's norms keep their weight as an offset from 1: the kernel's output (and the
    residual add before it) is the module's, whose arithmetic is fp32."""
    from hybridflow.models.norm import ZeroCenteredRMSNorm

    norm = ZeroCenteredRMSNorm(96, 1e-6).to(DEVICE)
    torch.nn.init.normal_(norm.weight, 0, 0.5)
    norm = norm.to(dtype)
    x, d = (torch.randn(5, 96, device=DEVICE).to(dtype) for _ in range(2))
    tolerance = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(rowwise.rms_norm(x, norm), norm(x), **tolerance)
    residual = x.clone()
    torch.testing.assert_close(rowwise.add_rms_norm(residual, d, norm), norm(x + d), **tolerance)
    torch.testing.assert_close(residual, x + d, **tolerance)  # bf16: the interpreter truncates


def test_qk_norm_in_place_matches_the_models_norms():
    """Strided q and k views of one projection (the fused q/k/v rows), normed in place."""
    rows, heads, kv_heads, dim = 5, 6, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=DEVICE)
    q = qkv[:, : heads * dim].unflatten(-1, (heads, dim))
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].unflatten(-1, (kv_heads, dim))
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    q_norm, k_norm = _Norm(dim), _Norm(dim)
    expected_q = F.rms_norm(q, (dim,), q_norm.weight, q_norm.eps)
    expected_k = F.rms_norm(k, (dim,), k_norm.weight, k_norm.eps)
    rowwise.qk_norm_(q, k, q_norm, k_norm)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)


def test_rope_store_matches_apply_rope():
    config = preset_config("tiny")
    rows, heads, kv_heads, dim, seq = 4, 4, 2, 16, 40
    q = torch.randn(rows, heads, dim, device=DEVICE)
    k = torch.randn(rows, kv_heads, dim, device=DEVICE)
    v = torch.randn(rows, kv_heads, dim, device=DEVICE)
    cos, sin = rope_cos_sin(config, torch.arange(seq, device=DEVICE), torch.float32)
    positions = torch.tensor([3, 0, 17, 39], device=DEVICE)
    slots = torch.tensor([2, 0, 1, 3], device=DEVICE)
    keys = _cache_like(5, seq, kv_heads, dim)
    values = _cache_like(5, seq, kv_heads, dim)
    rotated = q.clone()
    rowwise.rope_store(rotated, k, v, cos, sin, positions, slots, keys, values)
    c, s = cos[positions], sin[positions]
    torch.testing.assert_close(rotated, apply_rope(q, c, s))
    torch.testing.assert_close(keys[slots, positions], apply_rope(k, c, s))
    torch.testing.assert_close(values[slots, positions], v)
    # rotate_k: the same cache writes, and k itself rotated in place (a strided view)
    qkv = torch.cat([q, k, v], dim=1).reshape(rows, -1).clone()
    q2, k2, v2 = qkv.view(rows, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], 1)
    keys2, values2 = keys.clone().zero_(), values.clone().zero_()
    rowwise.rope_store(q2, k2, v2, cos, sin, positions, slots, keys2, values2, rotate_k=True)
    torch.testing.assert_close(k2, apply_rope(k, c, s))
    torch.testing.assert_close(q2, rotated)
    torch.testing.assert_close(v2, v)
    assert torch.equal(keys2, keys) and torch.equal(values2, values)
    untouched = keys.clone()
    untouched[slots, positions] = 0
    assert untouched.abs().max() == 0  # nothing else written


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_decode_attention_matches_sdpa(splits):
    rows, heads, kv_heads, dim, seq = 4, 6, 2, 16, 70
    q = torch.randn(rows, heads, dim, device=DEVICE)
    keys = _cache_like(5, seq, kv_heads, dim, torch.randn)
    values = _cache_like(5, seq, kv_heads, dim, torch.randn)
    slots = torch.tensor([2, 0, 1, 3], device=DEVICE)
    lengths = torch.tensor([4, 1, 18, 70], device=DEVICE)
    expected = cached_attention_torch(q, keys, values, slots, lengths, seq)
    got = attention.decode_attention(q, keys, values, slots, lengths, seq, splits=splits)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_attention_tuner_times_both_store_orders_only_where_they_differ():
    """The tuner times each tile with the new token's store before and after the loop (ROPE
    kernels); a kernel without the store compiles one order only."""
    prune = attention._prune_store_orders
    configs = attention._ATTENTION_CONFIGS
    tiles = {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs}
    both = prune(configs, {}, ROPE=True)
    assert len(both) == 2 * len(tiles)
    assert {c.kwargs["STORE_LAST"] for c in both} == {False, True}
    assert {c.kwargs["STORE_LAST"] for c in prune(configs, {}, ROPE=False)} == {False}


def test_pinned_attention_tiles_seed_the_tuner(monkeypatch):
    """tuned_tiles() -> pin_tiles() round trip (through JSON, as the pinned-choices file
    does): the autotuner finds the same config object under the same key, so it does not
    time; an entry whose config is no longer a candidate is skipped."""
    import json

    monkeypatch.setattr(attention._decode_attention_tuned, "cache", {})
    config = attention._ATTENTION_CONFIGS[3]
    key = (1, 8, 1, False, True, 16, 64, False, False, "torch.float32")
    attention._decode_attention_tuned.cache[key] = config
    saved = json.loads(json.dumps(attention.tuned_tiles()))
    attention._decode_attention_tuned.cache.clear()
    stale = {"key": [2], "config": {"kwargs": {"BLOCK_N": 999}, "num_warps": 4, "num_stages": 2}}
    assert attention.pin_tiles({**saved, "stale": stale}) == 1
    assert attention._decode_attention_tuned.cache == {key: config}


@pytest.mark.parametrize("store_last", [False, True])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_decode_attention_rope_equals_rope_store_then_attention(splits, store_last):
    """The fused decode kernel (RoPE + cache store + attention, the new token attended from
    registers) against the two-kernel path, including a row at position 0 (no cached
    tokens) and a row whose new token sits at the start of a split; with the new token's
    store before the loop or after it (the tuner's STORE_LAST, forced on an untuned launch)."""
    config = preset_config("tiny")
    rows, heads, kv_heads, dim, seq = 4, 6, 2, 16, 70
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=DEVICE)  # strided views
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, dim)) for t in (q, k, v))
    cos, sin = rope_cos_sin(config, torch.arange(seq, device=DEVICE), torch.float32)
    slots = torch.tensor([2, 0, 1, 3], device=DEVICE)
    positions = torch.tensor([3, 0, 24, 69], device=DEVICE)  # 24 = 70 // 3 + 1: split start
    keys = _cache_like(5, seq, kv_heads, dim, torch.randn)
    values = _cache_like(5, seq, kv_heads, dim, torch.randn)
    keys_ref, values_ref, q_ref = keys.clone(), values.clone(), q.clone()
    rowwise.rope_store(q_ref, k, v, cos, sin, positions, slots, keys_ref, values_ref)
    expected = attention.decode_attention(
        q_ref, keys_ref, values_ref, slots, positions + 1, seq, splits=splits
    )
    q_before = q.clone()
    got = attention._attention(q, k, v, cos, sin, positions, keys, values, slots, seq, splits,
                               autotune=False, store_last=store_last)  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(keys, keys_ref)  # rotated k stored, nothing else touched
    torch.testing.assert_close(values, values_ref)
    assert torch.equal(q, q_before)  # q is rotated in registers only


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_attention_rope_turns_each_slot_at_its_shift(splits):
    """shifts (mRoPE's per-slot rotary shift): each row turns at its position plus its
    slot's shift, and is stored and attended at its position, as rope_store at the shifted
    positions (cache_positions: the positions) then attention."""
    config = preset_config("tiny")
    rows, heads, kv_heads, dim, seq = 3, 4, 2, 16, 40
    q, k, v = (torch.randn(rows, n, dim, device=DEVICE) for n in (heads, kv_heads, kv_heads))
    cos, sin = rope_cos_sin(config, torch.arange(seq, device=DEVICE), torch.float32)
    slots = torch.tensor([2, 0, 1], device=DEVICE)
    positions = torch.tensor([9, 30, 5], device=DEVICE)
    shifts = torch.tensor([-4, 0, -7, 0], device=DEVICE)  # per slot; the last: scratch
    keys = _cache_like(4, seq, kv_heads, dim, torch.randn)
    values = _cache_like(4, seq, kv_heads, dim, torch.randn)
    keys_ref, values_ref, q_ref = keys.clone(), values.clone(), q.clone()
    rowwise.rope_store(q_ref, k, v, cos, sin, positions + shifts[slots], slots, keys_ref,
                       values_ref, cache_positions=positions)  # fmt: skip
    expected = attention.decode_attention(
        q_ref, keys_ref, values_ref, slots, positions + 1, seq, splits=splits
    )
    got = attention.decode_attention_rope(q, k, v, cos, sin, positions, keys, values, slots,
                                          seq, splits=splits, autotune=False,
                                          shifts=shifts)  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(keys, keys_ref)
    unshifted = attention.decode_attention_rope(q, k, v, cos, sin, positions, keys.clone(),
                                                values.clone(), slots, seq, splits=splits,
                                                autotune=False)  # fmt: skip
    assert not torch.allclose(unshifted, expected, atol=1e-3)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.2, min_p=0.1),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=30, top_p=0.8, min_p=0.02),
    ],
    ids=["greedy", "T1", "topk", "minp", "topp", "all-filters"],
)
def test_fused_sampler_matches_reference(params):
    """Same noise, same filters, one split of four tiles (test_sampler_fused.py takes several
    splits): identical tokens except where the fast log2 on CUDA flips a near-tie (allowed: 1
    of 16 rows); log-probs equal."""
    logits = torch.randn(16, 1000, device=DEVICE) * 3
    lo, hi = (t.to(DEVICE) for t in split_seed(request_seeds(5, 16, 1)))
    steps = torch.arange(16, device=DEVICE)
    ref_tokens, ref_logprobs = sample_reference(logits, params, lo, hi, steps)
    tokens, logprobs = sampler.sample_fused(logits, params, lo, hi, steps, block_v=256)
    assert (tokens != ref_tokens).sum().item() <= 1
    same = tokens == ref_tokens
    torch.testing.assert_close(logprobs[same], ref_logprobs[same], rtol=0, atol=1e-5)


@pytest.mark.parametrize("hidden", [40, 1536])
def test_fold_norm_weights_is_torchs_broadcast_multiply(hidden):
    """fold_norm_weights (FusedProjections' fold on CUDA) scales every row of each layer by
    that layer's norm weights, past a partial row block and (at 1536) across two column
    blocks: bitwise torch's multiply on CUDA; within one bf16 step under the interpreter,
    whose fp32 -> bf16 cast truncates instead of rounding to nearest."""
    gen = torch.Generator(DEVICE).manual_seed(hidden)
    weights = torch.randn(3, 37, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)
    norms = (torch.rand(3, hidden, generator=gen, device=DEVICE) + 0.5).to(torch.bfloat16)
    expected = weights.mul(norms[:, None, :])
    rowwise.fold_norm_weights(weights, norms)
    if DEVICE == "cuda":
        assert torch.equal(weights, expected)
    else:
        torch.testing.assert_close(weights, expected, rtol=2**-7, atol=0)


@pytest.mark.parametrize(
    "fuse,matmul,layer",
    [("none", "auto", "auto"), ("qkv", "auto", "auto"), ("all", "auto", "chain"),
     ("all", "auto", "split"), ("all", "cublas", "auto")],
)  # fmt: skip
def test_fast_engine_matches_eager_engine(fuse, matmul, layer):
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    prompts = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7]]
    # 4 new tokens: the 6 samples still outnumber the 4 slots (rows retire and refill) and
    # every token is a decode step through the fused path (the interpreter's cost)
    params = SamplingParams(n=2, temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=4, seed=3)
    options = EngineOptions(decode_backend="triton", fuse_projections=fuse, decode_matmul=matmul,
                            decode_layer=layer)  # fmt: skip
    fast = Engine(model, max_batch_size=4, max_seq_len=64, options=options)
    eager = Engine(model, max_batch_size=6, max_seq_len=64,
                   options=EngineOptions(decode_backend="torch", cuda_graphs=False))  # fmt: skip
    a, b = fast.generate(prompts, params), eager.generate(prompts, params)
    if fuse == "all" and layer == "chain":  # the five-launch layer ran, with a K split
        assert any(splits > 1 for _, splits in fast.chain.plans.values()) or DEVICE == "cuda"
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


@pytest.mark.skipif(DEVICE != "cuda", reason="flash attention (the bf16 prefill) needs CUDA")
def test_bf16_prefill_with_strided_flash_inputs_matches_model_prefill():
    """The fast prefill hands flash its q and v as strided column slices of the fused qkv
    product (no copies) and reads folded norm weights: its last-token logits stay within bf16
    noise of the model's own modules (a wrong row stride would give unrelated logits)."""
    from hybridflow.engine.cache.kv_cache import allocate_cache
    from hybridflow.engine.prefill import RopeTable, prefill_forward, prefill_forward_triton
    from hybridflow.engine.weights.fused import FusedProjections

    cfg = preset_config("tiny")
    model = build_model(cfg, seed=3, device=DEVICE).to(torch.bfloat16).eval()
    lengths = [7, 19, 12]
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
    slots = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    last = cu[1:] - 1
    rope = RopeTable(cfg, 32, torch.bfloat16, DEVICE)
    logits = []
    for forward, extra in [(prefill_forward, {}),
                           (prefill_forward_triton, {"fused": FusedProjections(model, True)})]:  # fmt: skip
        cache = allocate_cache(cfg.num_hidden_layers, 3, 32, cfg.num_key_value_heads,
                               cfg.head_dim, torch.bfloat16, DEVICE)  # fmt: skip
        logits.append(forward(model, cache, rope, ids, positions, slots, cu.to(torch.int32),
                              max(lengths), last, **extra).float())  # fmt: skip
    reference, fast = logits
    assert ((fast - reference).norm() / reference.norm()).item() < 0.05


@pytest.mark.skipif(DEVICE != "cuda", reason="programmatic dependent launch is a CUDA feature")
@pytest.mark.parametrize("layer", ["split", "chain"])
def test_pdl_launches_give_bitwise_the_same_generation(layer):
    """With PDL kernels start before the previous one ends and prefetch weights; the
    arithmetic is unchanged, so tokens and log-probs must be bitwise those of plain launches.
    A kernel that reads an activation before its wait would race and differ somewhere in
    24 x 48 sampled tokens of a 4-layer bf16 model at 48 rows (several waves)."""
    from hybridflow.engine.kernels.launch import supported

    if not supported(torch.device(DEVICE)):
        pytest.skip("PDL needs sm_90 and a Triton with grid dependency control")
    model = build_model(preset_config("tiny-4l"), seed=2, device=DEVICE).to(torch.bfloat16)
    vocab = model.config.vocab_size
    prompts = [[(7 * i + j) % (vocab - 3) + 3 for j in range(5 + i % 9)] for i in range(24)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=48, seed=11, ignore_eos=True)
    results, first = {}, None
    for pdl in (False, True):
        options = EngineOptions(pdl=pdl, decode_layer=layer)
        engine = Engine(model.eval(), max_batch_size=48, max_seq_len=64, options=options)
        if first is not None:  # the same tiles and K splits (chosen by timing) both times
            engine.matmul.choices.update(first.matmul.choices)
            engine.chain.plans.update(first.chain.plans)
        out = engine.generate(prompts, params)
        first = first or engine
        results[pdl] = ([c.token_ids for c in out], [c.logprobs for c in out])
        engine.release()
    assert results[True][0] == results[False][0]
    assert results[True][1] == results[False][1]


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned, non-blocking snapshot copies are CUDA's")
def test_lagged_snapshots_on_cuda_give_the_same_tokens():
    """sync_lag=1 reads each chunk's flags and tokens from pinned host copies one chunk late,
    while the next chunk's graphs run; a read before its copy landed would show as wrong or
    missing tokens against sync_lag=0 (early stops, 40 requests through 8 slots, 2 steps per
    chunk: many chunks, retirements and admissions). fp32: the two loops admit rows at other
    steps, so batch sizes differ, and bf16 rounding could flip a sample."""
    model = build_model(preset_config("tiny-4l"), seed=2, device=DEVICE)
    vocab = model.config.vocab_size
    prompts = [[(5 * i + j) % (vocab - 3) + 3 for j in range(3 + i % 7)] for i in range(20)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=7, ignore_eos=True,
                            stop_token_ids=list(range(3, 3 + vocab // 12)))  # fmt: skip
    results = {}
    for lag in (0, 1):
        options = EngineOptions(sync_lag=lag, steps_per_sync=2)
        engine = Engine(model.eval(), max_batch_size=8, max_seq_len=64, options=options)
        out = engine.generate(prompts, params)
        results[lag] = [(c.token_ids, c.finish_reason) for c in out]
        engine.release()
    assert results[1] == results[0]
    reasons = [reason for _, reason in results[1]]
    assert "stop" in reasons and "length" in reasons


def test_kept_kv_continuation_on_the_fused_path_matches_a_full_prefill():
    """The triton extend pass (rope_store for every new token, then decode attention over
    the slot) continues a kept slot: turn 2's tokens equal a full prefill's (the eager
    engine's), fp32."""
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    prompts = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7]]
    deltas = [[7, 8, 9], [11], [3, 4, 5, 6, 7, 8, 9, 10]]
    params = SamplingParams(temperature=0.9, max_new_tokens=5, ignore_eos=True)
    # the full prefill on the eager engine (an interpreted triton engine's would cost as
    # much as the kept one's two turns)
    options = {False: EngineOptions(decode_backend="torch", cuda_graphs=False),
               True: EngineOptions(decode_backend="triton")}  # fmt: skip
    results = {}
    for keep in (False, True):
        engine = Engine(model, max_batch_size=4, max_seq_len=64, options=options[keep])
        first = engine.generate(prompts, params, seeds=[1, 2, 3], keep=keep)
        turn2 = [p + c.token_ids + d for p, c, d in zip(prompts, first, deltas)]
        handles = [c.kv_handle for c in first] if keep else None
        results[keep] = engine.generate(turn2, params, seeds=[4, 5, 6], reuse=handles)
    assert [c.token_ids for c in results[True]] == [c.token_ids for c in results[False]]
    for a, b in zip(results[True], results[False]):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
