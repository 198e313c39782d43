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

from hybridflow.engine import Engine, SamplingParams, attention_kernels, kernels, sampler_kernels  # noqa: E402
from hybridflow.engine.forward import cached_attention_torch  # noqa: E402
from hybridflow.engine.sampling import request_seeds, sample_reference, split_seed  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402
from hybridflow.models.rope import apply_rope, rope_cos_sin  # noqa: E402


def _cache_like(slots, seq, kv_heads, dim, layout, fill=torch.zeros):
    """A one-layer cache view [slots, seq, kv_heads, dim] stored token- or head-major."""
    if layout == "head":
        return fill(slots, kv_heads, seq, dim, device=DEVICE).transpose(1, 2)
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
    torch.testing.assert_close(kernels.add_rms_norm(residual, d, norm), expected)
    torch.testing.assert_close(residual, x + d)
    torch.testing.assert_close(kernels.rms_norm(x, norm), F.rms_norm(x, (96,), norm.weight, 1e-6))
    unweighted = kernels.rms_norm(x, norm, weighted=False)
    torch.testing.assert_close(unweighted, F.rms_norm(x, (96,), None, 1e-6))
    # several rows per program (5 rows: the last program is partly masked)
    residual, out = x.clone(), torch.empty_like(x)
    kernels._launch_rms_norm(residual, d, norm.weight, out, norm.eps, add=True, weighted=True,
                             per_program=4)  # fmt: skip
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(residual, x + d)
    gate_up = torch.randn(3, 400, device=DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)  # strided halves, as with fused gate/up weights
    torch.testing.assert_close(kernels.silu_mul(gate, up), F.silu(gate) * up)
    interleaved = torch.stack([gate, up], dim=-1).flatten(1)  # gate_0, up_0, gate_1, ...
    torch.testing.assert_close(kernels.silu_mul_pairs(interleaved), F.silu(gate) * up)


@pytest.mark.parametrize("layout", ["token", "head"])
def test_rope_store_matches_apply_rope(layout):
    config = preset_config("tiny")
    rows, heads, kv_heads, dim, seq = 4, 4, 2, 16, 40
    q = torch.randn(rows, heads, dim, device=DEVICE)
    k = torch.randn(rows, kv_heads, dim, device=DEVICE)
    v = torch.randn(rows, kv_heads, dim, device=DEVICE)
    cos, sin = rope_cos_sin(config, torch.arange(seq, device=DEVICE), torch.float32)
    positions = torch.tensor([3, 0, 17, 39], device=DEVICE)
    slots = torch.tensor([2, 0, 1, 3], device=DEVICE)
    keys = _cache_like(5, seq, kv_heads, dim, layout)
    values = _cache_like(5, seq, kv_heads, dim, layout)
    rotated = q.clone()
    kernels.rope_store(rotated, k, v, cos, sin, positions, slots, keys, values)
    c, s = cos[positions], sin[positions]
    torch.testing.assert_close(rotated, apply_rope(q, c, s))
    torch.testing.assert_close(keys[slots, positions], apply_rope(k, c, s))
    torch.testing.assert_close(values[slots, positions], v)
    # rotate_k: the same cache writes, and k itself rotated in place (a strided view)
    qkv = torch.cat([q, k, v], dim=1).reshape(rows, -1).clone()
    q2, k2, v2 = qkv.view(rows, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], 1)
    keys2, values2 = keys.clone().zero_(), values.clone().zero_()
    kernels.rope_store(q2, k2, v2, cos, sin, positions, slots, keys2, values2, rotate_k=True)
    torch.testing.assert_close(k2, apply_rope(k, c, s))
    torch.testing.assert_close(q2, rotated)
    torch.testing.assert_close(v2, v)
    assert torch.equal(keys2, keys) and torch.equal(values2, values)
    untouched = keys.clone()
    untouched[slots, positions] = 0
    assert untouched.abs().max() == 0  # nothing else written


@pytest.mark.parametrize("layout", ["token", "head"])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_decode_attention_matches_sdpa(splits, layout):
    rows, heads, kv_heads, dim, seq = 4, 6, 2, 16, 70
    q = torch.randn(rows, heads, dim, device=DEVICE)
    keys = _cache_like(5, seq, kv_heads, dim, layout, torch.randn)
    values = _cache_like(5, seq, kv_heads, dim, layout, torch.randn)
    slots = torch.tensor([2, 0, 1, 3], device=DEVICE)
    lengths = torch.tensor([4, 1, 18, 70], device=DEVICE)
    expected = cached_attention_torch(q, keys, values, slots, lengths, seq)
    got = attention_kernels.decode_attention(q, keys, values, slots, lengths, seq, splits=splits)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_attention_tuner_times_both_store_orders_only_where_they_differ(monkeypatch):
    """STORE_LAST None lets the tuner time each tile with the store before and after the loop
    (ROPE kernels); a forced value or a kernel without the store compiles one order only."""
    prune = attention_kernels._prune_store_orders
    configs = attention_kernels._ATTENTION_CONFIGS
    tiles = {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs}
    monkeypatch.setattr(attention_kernels, "STORE_LAST", None)
    both = prune(configs, {}, ROPE=True)
    assert len(both) == 2 * len(tiles)
    assert {c.kwargs["STORE_LAST"] for c in both} == {False, True}
    assert {c.kwargs["STORE_LAST"] for c in prune(configs, {}, ROPE=False)} == {False}
    monkeypatch.setattr(attention_kernels, "STORE_LAST", True)
    forced = prune(configs, {}, ROPE=True)
    assert len(forced) == len(tiles) and all(c.kwargs["STORE_LAST"] for c in forced)


@pytest.mark.parametrize("store_last", [False, True])
@pytest.mark.parametrize("layout", ["token", "head"])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_decode_attention_rope_equals_rope_store_then_attention(splits, layout, store_last,
                                                                 monkeypatch):  # fmt: skip
    """The fused decode kernel (RoPE + cache store + attention, the new token attended from
    registers) against the two-kernel path, including a row at position 0 (no cached
    tokens) and a row whose new token sits at the start of a split; with the new token's
    store before the loop or after it (STORE_LAST)."""
    monkeypatch.setattr(attention_kernels, "STORE_LAST", store_last)
    # a fresh tuning cache, or a GPU run reuses the order tuned by the other parametrisation
    monkeypatch.setattr(attention_kernels._decode_attention_tuned, "cache", {})
    config = preset_config("tiny")
    rows, heads, kv_heads, dim, seq = 4, 6, 2, 16, 70
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=DEVICE)  # strided views
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, dim)) for t in (q, k, v))
    cos, sin = rope_cos_sin(config, torch.arange(seq, device=DEVICE), torch.float32)
    slots = torch.tensor([2, 0, 1, 3], device=DEVICE)
    positions = torch.tensor([3, 0, 24, 69], device=DEVICE)  # 24 = 70 // 3 + 1: split start
    keys = _cache_like(5, seq, kv_heads, dim, layout, torch.randn)
    values = _cache_like(5, seq, kv_heads, dim, layout, torch.randn)
    keys_ref, values_ref, q_ref = keys.clone(), values.clone(), q.clone()
    kernels.rope_store(q_ref, k, v, cos, sin, positions, slots, keys_ref, values_ref)
    expected = attention_kernels.decode_attention(
        q_ref, keys_ref, values_ref, slots, positions + 1, seq, splits=splits
    )
    q_before = q.clone()
    got = attention_kernels.decode_attention_rope(
        q, k, v, cos, sin, positions, keys, values, slots, seq, splits=splits
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(keys, keys_ref)  # rotated k stored, nothing else touched
    torch.testing.assert_close(values, values_ref)
    assert torch.equal(q, q_before)  # q is rotated in registers only


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
    """Same noise, same filters: identical tokens except where the fast log2 on CUDA flips a
    near-tie (allowed: 1 of 64 rows); log-probs equal."""
    logits = torch.randn(64, 3000, device=DEVICE) * 3
    lo, hi = (t.to(DEVICE) for t in split_seed(request_seeds(5, 64, 1)))
    steps = torch.arange(64, device=DEVICE)
    ref_tokens, ref_logprobs = sample_reference(logits, params, lo, hi, steps)
    tokens, logprobs = sampler_kernels.sample_fused(logits, params, lo, hi, steps, block_v=256)
    assert (tokens != ref_tokens).sum().item() <= 1
    same = tokens == ref_tokens
    torch.testing.assert_close(logprobs[same], ref_logprobs[same], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "fuse,matmul,norms,layout",
    [("none", "auto", "auto", "token"), ("qkv", "auto", "auto", "token"),
     ("all", "auto", "on", "token"), ("all", "auto", "off", "token"),
     ("all", "cublas", "auto", "token"), ("all", "auto", "on", "head")],
)  # fmt: skip
def test_fast_engine_matches_eager_engine(fuse, matmul, norms, layout, monkeypatch):
    from hybridflow.engine import kv_cache

    monkeypatch.setattr(kv_cache, "LAYOUT", layout)
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    prompts = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7]]
    params = SamplingParams(n=2, temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=8, seed=3)
    fast = Engine(model, max_batch_size=4, max_seq_len=64, decode_backend="triton",
                  fuse_projections=fuse, decode_matmul=matmul, fuse_norms=norms)  # fmt: skip
    eager = Engine(model, max_batch_size=6, max_seq_len=64, decode_backend="torch",
                   cuda_graphs=False)  # fmt: skip
    a, b = fast.generate(prompts, params), eager.generate(prompts, params)
    if fuse == "all" and norms == "on":  # the five-launch layer ran, with a K split
        assert any(splits > 1 for _, splits in fast.chain.plans.values()) or DEVICE == "cuda"
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


def _matmul_reference(x, weight, bias=None, up=None):
    """fp64 reference; with up, the activation rounded like torch (silu, then the product)."""
    if up is not None:
        x = F.silu(x.float()).to(x.dtype).float() * up.float()
        x = x.to(up.dtype)
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


def _relative_error(out, ref):
    assert not out.isnan().any()
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,depth", [(5, 72, 64), (33, 130, 96), (16, 64, 128)])
def test_gemm_nt_matches_reference(dtype, rows, cols, depth):
    """Plain + bias, split-K partials (summed by the caller) and the SiLU-pairs epilogue, on
    strided input rows, with an odd row count and a column count that is not a tile multiple."""
    from hybridflow.engine import gemm, matmul_choice

    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the Triton interpreter's bf16 tl.dot returns garbage (triton 3.6)")
    configs = [gemm.INTERPRETER_CONFIG]
    if DEVICE == "cuda":
        configs = [(16, 32, 32, 4, 3), *matmul_choice.PAIR_CONFIGS]
    weight = torch.randn(cols, depth, device=DEVICE).to(dtype)
    bias = torch.randn(cols, device=DEVICE).to(dtype)
    x = torch.randn(rows, 2 * depth, device=DEVICE).to(dtype)[:, :depth]  # strided rows
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    pairs = gemm.interleave_pairs(weight[: cols // 2], weight[cols // 2 : 2 * (cols // 2)])
    ran = 0
    for config in configs:
        if depth % config[2]:
            continue
        try:
            out = gemm.gemm_nt(x, weight, bias, config=config)
        except Exception as error:  # fp32 tiles can exceed shared memory; DecodeMatmul skips
            if type(error).__name__ != "OutOfResources":
                raise
            continue
        ran += 1
        assert _relative_error(out, _matmul_reference(x, weight, bias)) < bound, config
        if depth % (2 * config[2]) == 0:
            partials = gemm.gemm_nt(x, weight, config=config, splits=2)
            assert partials.shape == (2, rows, cols) and partials.dtype == torch.float32
            ref = _matmul_reference(x, weight, None)
            assert _relative_error(partials.sum(0), ref) < bound, config
        act = gemm.gemm_nt(x, pairs, config=config, silu_pairs=True)
        gate, up = F.linear(x, pairs[0::2]), F.linear(x, pairs[1::2])
        assert act.shape == (rows, cols // 2)
        assert _relative_error(act, (F.silu(gate) * up).double()) < bound, config
        # the cuBLAS path of the same op agrees (interleaved columns through silu_mul)
        cublas = gemm.gate_up_silu_cublas(x, pairs)
        assert _relative_error(act, cublas.double()) < bound, config
    assert ran > 0, "no tile configuration fits this device"
    with pytest.raises(ValueError, match="splits"):
        gemm.gemm_nt(x, weight, config=configs[0], splits=5)


@pytest.mark.parametrize("rows,cols,depth", [(5, 130, 64), (33, 72, 128)])
def test_gemm_nt_tma_tiles_equal_pointer_tiles(rows, cols, depth, monkeypatch):
    """gemm.TMA changes only how tiles reach shared memory (rows/columns past the end read as
    zeros either way): plain, split-K and SiLU-pair outputs are bitwise equal."""
    from hybridflow.engine import gemm

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    x = torch.randn(rows, 2 * depth, device=DEVICE).to(dtype)[:, :depth]  # strided rows
    weight = torch.randn(cols, depth, device=DEVICE).to(dtype)
    bias = torch.randn(cols, device=DEVICE).to(dtype)
    config = gemm.INTERPRETER_CONFIG if DEVICE == "cpu" else (64, 64, 32, 4, 3)  # K = 64: 2 splits
    assert gemm.tma_operands(x, weight, *config[:3])[-1]  # the default takes TMA here
    outputs = {}
    for tma in (True, False):
        monkeypatch.setattr(gemm, "TMA", tma)
        assert gemm.tma_operands(x, weight, *config[:3])[-1] == tma
        outputs[tma] = (
            gemm.gemm_nt(x, weight, bias, config=config),
            gemm.gemm_nt(x, weight, config=config, splits=2),
            gemm.gemm_nt(x, weight[: cols // 2 * 2], config=config, silu_pairs=True),
        )
    for with_tma, without in zip(outputs[True], outputs[False]):
        assert torch.equal(with_tma, without)


@pytest.mark.parametrize("rows,cols,depth", [(37, 192, 128), (300, 512, 256)])
def test_gemm_persistent_equals_gemm_nt(rows, cols, depth):
    """The persistent kernel is gemm_nt's arithmetic looped over tiles: for the same tile it
    gives bitwise the same plain, biased and SiLU-pair outputs whatever the number of
    programs (one, a few that each take many tiles, more than there are tiles)."""
    from hybridflow.engine import gemm, matmul_choice
    from hybridflow.engine.gemm_persistent import gemm_persistent

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    configs = ([(*gemm.INTERPRETER_CONFIG, 2)] if DEVICE == "cpu"
               else matmul_choice.PERSISTENT_CONFIGS)  # fmt: skip
    x = torch.randn(rows, depth, device=DEVICE).to(dtype)
    weight = torch.randn(cols, depth, device=DEVICE).to(dtype)
    bias = torch.randn(cols, device=DEVICE).to(dtype)
    for config in configs:
        tile = config[:5]
        expected = (
            gemm.gemm_nt(x, weight, bias, config=tile),
            gemm.gemm_nt(x, weight, config=tile, silu_pairs=True),
        )
        for programs in (1, 3, 10_000):
            got = (
                gemm_persistent(x, weight, bias, config=config, programs=programs),
                gemm_persistent(x, weight, config=config, programs=programs, silu_pairs=True),
            )
            for g, e in zip(got, expected):
                assert torch.equal(g, e), (config, programs)


@pytest.mark.parametrize(
    "rows,cols,depth",
    # the interpreter runs every program in turn: small shapes there (62 s for the GPU's)
    [(37, 192, 128), (70, 256, 160) if DEVICE == "cpu" else (300, 512, 320)],
)
def test_gemm_streamk_equals_gemm_nt_and_is_deterministic(rows, cols, depth):
    """Stream-K splits the (tile, K-step) iterations evenly over the programs. With whole
    tiles per program (one program, one per tile) it is gemm_nt bitwise; with tiles cut in
    two (programs between) it matches gemm_nt to the rounding of a two-part K sum, gives the
    same bits on a second run, and leaves its arrival counts at zero for the next launch."""
    import triton

    from hybridflow.engine import gemm, gemm_persistent, matmul_choice

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    configs = ([(*gemm.INTERPRETER_CONFIG, 2)] if DEVICE == "cpu"
               else matmul_choice.STREAMK_CONFIGS)  # fmt: skip
    x = torch.randn(rows, depth, device=DEVICE).to(dtype)
    weight = torch.randn(cols, depth, device=DEVICE).to(dtype)
    bias = torch.randn(cols, device=DEVICE).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    for config in configs:
        tile = config[:5]
        tiles = triton.cdiv(rows, config[0]) * triton.cdiv(cols, config[1])
        expected = (
            gemm.gemm_nt(x, weight, bias, config=tile),
            gemm.gemm_nt(x, weight, config=tile, silu_pairs=True),
        )

        def run(programs, config=config):
            return (
                gemm_persistent.gemm_streamk(x, weight, bias, config=config, programs=programs),
                gemm_persistent.gemm_streamk(x, weight, config=config, programs=programs,
                                             silu_pairs=True),
            )  # fmt: skip

        for programs in (1, tiles, 10_000):
            for g, e in zip(run(programs), expected):
                assert torch.equal(g, e), (config, programs)
        for programs in sorted({2, 5, max(2, tiles - 1)}):
            first, second = run(programs), run(programs)
            for g, again, e in zip(first, second, expected):
                torch.testing.assert_close(g.float(), e.float(), **tol)
                assert torch.equal(g, again), (config, programs)
            scratch = gemm_persistent._STREAMK_SCRATCH[(x.device.type, x.device.index)]
            assert not scratch[1].any(), "a count left non-zero breaks the next launch"


def test_gemm_persistent_reads_a_partial_last_k_block_as_zeros():
    """K need not be a multiple of BLOCK_K (TMA fills past the end with zeros): the product
    matches torch's; operands TMA cannot read are refused by name."""
    from hybridflow.engine import gemm
    from hybridflow.engine.gemm_persistent import gemm_persistent

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    config = (*gemm.INTERPRETER_CONFIG, 2) if DEVICE == "cpu" else (128, 128, 64, 8, 3, 8)
    depth = config[2] * 2 + 8  # 16-byte rows in either dtype
    x = torch.randn(70, depth, device=DEVICE).to(dtype)
    weight = torch.randn(96, depth, device=DEVICE).to(dtype)
    out = gemm_persistent(x, weight, config=config, programs=4)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(out.float(), (x.double() @ weight.double().T).float(), **tol)
    odd = torch.randn(70, depth + 1, device=DEVICE).to(dtype)[:, :depth]  # unaligned row stride
    with pytest.raises(ValueError, match="TMA"):
        gemm_persistent(odd, weight, config=config, programs=4)


def test_decode_matmul_runs_its_persistent_choice(monkeypatch):
    """A ("persistent", tile, programs per SM) choice runs gemm_persistent with that many
    programs per SM, giving what gemm_nt gives for the tile."""
    from hybridflow.engine import gemm, gemm_persistent, matmul_choice

    monkeypatch.setattr(matmul_choice, "_sm_count", lambda device: 3)
    launched = []
    real = gemm_persistent.gemm_persistent

    def spy(*args, programs, **kwargs):
        launched.append(programs)
        return real(*args, programs=programs, **kwargs)

    monkeypatch.setattr(matmul_choice, "gemm_persistent", spy)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    config = (*gemm.INTERPRETER_CONFIG, 2) if DEVICE == "cpu" else (128, 128, 64, 8, 3, 8)
    x = torch.randn(50, 128, device=DEVICE).to(dtype)
    pairs = torch.randn(128, 128, device=DEVICE).to(dtype)
    out = matmul_choice.DecodeMatmul._run(("persistent", config, 2), x, pairs)
    assert launched == [6]
    assert torch.equal(out, gemm.gemm_nt(x, pairs, config=config[:5], silu_pairs=True))
    # rows TMA cannot read (an odd row stride) fall back to cuBLAS + silu_mul, not an error
    odd = torch.randn(50, 129, device=DEVICE).to(dtype)[:, :128]
    out = matmul_choice.DecodeMatmul._run(("persistent", config, 2), odd, pairs)
    assert launched == [6]
    torch.testing.assert_close(out, gemm.gate_up_silu_cublas(odd, pairs))


def test_decode_matmul_runs_its_streamk_choice(monkeypatch):
    """A ("streamk", tile, programs per SM) choice runs gemm_streamk with that many programs
    per SM; its result matches gemm_nt's for the tile (a K sum cut in two)."""
    from hybridflow.engine import gemm, matmul_choice

    monkeypatch.setattr(matmul_choice, "_sm_count", lambda device: 3)
    launched = []
    real = matmul_choice.gemm_streamk

    def spy(*args, programs, **kwargs):
        launched.append(programs)
        return real(*args, programs=programs, **kwargs)

    monkeypatch.setattr(matmul_choice, "gemm_streamk", spy)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    config = (*gemm.INTERPRETER_CONFIG, 2) if DEVICE == "cpu" else (128, 128, 64, 8, 3, 8)
    x = torch.randn(50, 128, device=DEVICE).to(dtype)
    pairs = torch.randn(128, 128, device=DEVICE).to(dtype)
    out = matmul_choice.DecodeMatmul._run(("streamk", config, 2), x, pairs)
    assert launched == [6]
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    expected = gemm.gemm_nt(x, pairs, config=config[:5], silu_pairs=True)
    torch.testing.assert_close(out.float(), expected.float(), **tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="the tuner times CUDA-graph replays")
def test_decode_matmul_times_persistent_candidates_at_large_row_counts():
    from hybridflow.engine import matmul_choice
    from hybridflow.engine.gemm import gate_up_silu_cublas

    matmul = matmul_choice.DecodeMatmul("auto")
    x = torch.randn(1024, 256, device=DEVICE, dtype=torch.bfloat16)
    pairs = torch.randn(1024, 256, device=DEVICE, dtype=torch.bfloat16)
    out = matmul.gate_up_silu(x, pairs)
    timings = next(iter(matmul.timings.values()))
    assert sum(k.startswith("('persistent'") for k in timings) == len(
        matmul_choice.PERSISTENT_CONFIGS
    ) * len(matmul_choice.PERSISTENT_PER_SM)
    torch.testing.assert_close(out, gate_up_silu_cublas(x, pairs), rtol=2e-2, atol=5e-2)


def test_decode_matmul_modes_agree():
    from hybridflow.engine.gemm import gate_up_silu_cublas, interleave_pairs
    from hybridflow.engine.matmul_choice import DecodeMatmul

    x = torch.randn(24, 128, device=DEVICE)
    weight, bias = torch.randn(96, 128, device=DEVICE), torch.randn(96, device=DEVICE)
    pairs = interleave_pairs(weight[:48], weight[48:])
    expected = gate_up_silu_cublas(x, pairs)
    torch.testing.assert_close(expected, F.silu(x @ weight[:48].T) * (x @ weight[48:].T))
    for mode in ("auto", "triton", "cublas"):
        matmul = DecodeMatmul(mode)
        torch.testing.assert_close(matmul.linear(x, weight, bias), F.linear(x, weight, bias))
        torch.testing.assert_close(matmul.gate_up_silu(x, pairs), expected, rtol=1e-4, atol=1e-3)
    big = DecodeMatmul("triton", max_rows=8)  # rows above max_rows: cuBLAS, no tuning
    torch.testing.assert_close(big.gate_up_silu(x, pairs), expected)
    assert big.choices == {}
    with pytest.raises(ValueError, match="decode matmul mode"):
        DecodeMatmul("fast")


@pytest.mark.skipif(DEVICE != "cuda", reason="flash attention (the bf16 prefill) needs CUDA")
def test_bf16_prefill_with_strided_flash_inputs_matches_model_prefill():
    """The fast prefill hands flash its q and v as strided column slices of the fused qkv
    product (no copies) and reads folded norm weights: its last-token logits stay within bf16
    noise of the model's own modules (a wrong row stride would give unrelated logits)."""
    from hybridflow.engine.forward import (
        FusedProjections,
        RopeTable,
        prefill_forward,
        prefill_forward_triton,
    )
    from hybridflow.engine.kv_cache import allocate_cache

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
@pytest.mark.parametrize("norms", ["off", "on"])
def test_pdl_launches_give_bitwise_the_same_generation(norms):
    """With PDL (pdl.py) kernels start before the previous one ends and prefetch weights and
    cached K/V; the arithmetic is unchanged, so tokens and log-probs must be bitwise those of
    plain launches. A kernel that reads an activation before its wait would race and differ
    somewhere in 24 x 48 sampled tokens of a 4-layer bf16 model at 48 rows (several waves)."""
    from hybridflow.engine import pdl

    if not pdl.SUPPORTED or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 and a Triton with grid dependency control")
    model = build_model(preset_config("tiny-4l"), seed=2, device=DEVICE).to(torch.bfloat16)
    vocab = model.config.vocab_size
    prompts = [[(7 * i + j) % (vocab - 3) + 3 for j in range(5 + i % 9)] for i in range(24)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=48, seed=11, ignore_eos=True)
    results, first = {}, None
    try:
        for mode in (False, True):
            pdl.ENABLED = mode
            engine = Engine(model.eval(), max_batch_size=48, max_seq_len=64, fuse_norms=norms)
            if first is not None:  # the same tiles and K splits (chosen by timing) both times
                engine.matmul.choices.update(first.matmul.choices)
                engine.chain.plans.update(first.chain.plans)
            out = engine.generate(prompts, params)
            first = first or engine
            results[mode] = ([c.token_ids for c in out], [c.logprobs for c in out])
            engine.release()
    finally:
        pdl.ENABLED = None
    assert results[True][0] == results[False][0]
    assert results[True][1] == results[False][1]


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned, non-blocking snapshot copies are CUDA's")
def test_lagged_snapshots_on_cuda_give_the_same_tokens(monkeypatch):
    """loop.SYNC_LAG = 1 reads each chunk's flags and tokens from pinned host copies one
    chunk late, while the next chunk's graphs run; a read before its copy landed would show
    as wrong or missing tokens against SYNC_LAG = 0 (early stops, 40 requests through 8
    slots, 2 steps per chunk: many chunks, retirements and admissions). fp32: the two loops
    admit rows at other steps, so batch sizes differ, and bf16 rounding could flip a sample."""
    from hybridflow.engine import loop as loop_module

    model = build_model(preset_config("tiny-4l"), seed=2, device=DEVICE)
    vocab = model.config.vocab_size
    prompts = [[(5 * i + j) % (vocab - 3) + 3 for j in range(3 + i % 7)] for i in range(20)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=7, ignore_eos=True,
                            stop_token_ids=list(range(3, 3 + vocab // 12)))  # fmt: skip
    results = {}
    for lag in (0, 1):
        monkeypatch.setattr(loop_module, "SYNC_LAG", lag)
        engine = Engine(model.eval(), max_batch_size=8, max_seq_len=64, steps_per_sync=2)
        out = engine.generate(prompts, params)
        results[lag] = [(c.token_ids, c.finish_reason) for c in out]
        engine.release()
    assert results[1] == results[0]
    reasons = [reason for _, reason in results[1]]
    assert "stop" in reasons and "length" in reasons
