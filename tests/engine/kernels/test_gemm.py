"""gemm.py, gemm_persistent.py and matmul_choice.py: the Triton matmuls (gemm_nt's tiles,
the persistent kernel) against torch and each other, and DecodeMatmul's
choices. Runs on CUDA (marked gpu), or on CPU under TRITON_INTERPRET=1 when triton is
installed (make test runs them so); skipped otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


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
    from hybridflow.engine.kernels import gemm
    from hybridflow.engine.layers import matmul_choice

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
def test_gemm_nt_tma_tiles_equal_pointer_tiles(rows, cols, depth):
    """Launch.tma changes only how tiles reach shared memory (rows/columns past the end read
    as zeros either way): plain, split-K and SiLU-pair outputs are bitwise equal."""
    from hybridflow.engine.kernels import gemm
    from hybridflow.engine.kernels.launch import Launch

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    x = torch.randn(rows, 2 * depth, device=DEVICE).to(dtype)[:, :depth]  # strided rows
    weight = torch.randn(cols, depth, device=DEVICE).to(dtype)
    bias = torch.randn(cols, device=DEVICE).to(dtype)
    config = gemm.INTERPRETER_CONFIG if DEVICE == "cpu" else (64, 64, 32, 4, 3)  # K = 64: 2 splits
    outputs = {}
    for tma in (True, False):
        assert gemm.tma_operands(x, weight, *config[:3], tma)[-1] == tma
        launch = Launch(tma=tma)
        outputs[tma] = (
            gemm.gemm_nt(x, weight, bias, config=config, launch=launch),
            gemm.gemm_nt(x, weight, config=config, splits=2, launch=launch),
            gemm.gemm_nt(
                x, weight[: cols // 2 * 2], config=config, silu_pairs=True, launch=launch
            ),  # fmt: skip
        )
    for with_tma, without in zip(outputs[True], outputs[False]):
        assert torch.equal(with_tma, without)


# many tiles per program at the GPU's tiles; under the interpreter's 16 x 32 tiles a smaller
# product has 56 of them (23 s less of numpy)
MANY_TILES = (100, 256, 96) if DEVICE == "cpu" else (300, 512, 256)


@pytest.mark.parametrize("rows,cols,depth", [(37, 192, 128), MANY_TILES])
def test_gemm_persistent_equals_gemm_nt(rows, cols, depth):
    """The persistent kernel is gemm_nt's arithmetic looped over tiles: for the same tile it
    gives bitwise the same plain, biased and SiLU-pair outputs whatever the number of
    programs (one, a few that each take many tiles, more than there are tiles)."""
    from hybridflow.engine.kernels import gemm
    from hybridflow.engine.kernels.gemm_persistent import gemm_persistent
    from hybridflow.engine.layers import matmul_choice

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


def test_gemm_persistent_reads_a_partial_last_k_block_as_zeros():
    """K need not be a multiple of BLOCK_K (TMA fills past the end with zeros): the product
    matches torch's; operands TMA cannot read are refused by name."""
    from hybridflow.engine.kernels import gemm
    from hybridflow.engine.kernels.gemm_persistent import gemm_persistent

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
    """A ("persistent", tile, programs per SM) choice runs that kernel with that many programs
    per SM, giving bitwise what gemm_nt gives for the tile; rows TMA cannot read fall back to
    cuBLAS + silu_mul."""
    from hybridflow.engine.kernels import gemm
    from hybridflow.engine.kernels.launch import Launch
    from hybridflow.engine.layers import matmul_choice

    monkeypatch.setattr(matmul_choice, "sm_count", lambda device: 3)
    launched = []
    real = matmul_choice.gemm_persistent

    def spy(*args, programs, **kwargs):
        launched.append(programs)
        return real(*args, programs=programs, **kwargs)

    monkeypatch.setattr(matmul_choice, "gemm_persistent", spy)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    config = (*gemm.INTERPRETER_CONFIG, 2) if DEVICE == "cpu" else (128, 128, 64, 8, 3, 8)
    x = torch.randn(50, 128, device=DEVICE).to(dtype)
    pairs = torch.randn(128, 128, device=DEVICE).to(dtype)
    tma = Launch(tma=True)
    out = matmul_choice.DecodeMatmul._run(("persistent", config, 2), x, pairs, tma)
    assert launched == [6]
    assert torch.equal(out, gemm.gemm_nt(x, pairs, config=config[:5], silu_pairs=True))
    odd = torch.randn(50, 129, device=DEVICE).to(dtype)[:, :128]  # an odd row stride
    out = matmul_choice.DecodeMatmul._run(("persistent", config, 2), odd, pairs, tma)
    assert launched == [6]
    torch.testing.assert_close(out, gemm.gate_up_silu_cublas(odd, pairs))


@pytest.mark.skipif(DEVICE != "cuda", reason="the tuner times CUDA-graph replays")
def test_decode_matmul_times_persistent_candidates_at_large_row_counts():
    from hybridflow.engine.kernels.gemm import gate_up_silu_cublas
    from hybridflow.engine.kernels.launch import launch_for
    from hybridflow.engine.layers import matmul_choice

    matmul = matmul_choice.DecodeMatmul("auto")
    x = torch.randn(1024, 256, device=DEVICE, dtype=torch.bfloat16)
    pairs = torch.randn(1024, 256, device=DEVICE, dtype=torch.bfloat16)
    out = matmul.gate_up_silu(x, pairs, launch_for(x.device))
    timings = next(iter(matmul.timings.values()))
    assert sum(k.startswith("('persistent'") for k in timings) == len(
        matmul_choice.PERSISTENT_CONFIGS
    ) * len(matmul_choice.PERSISTENT_PER_SM)
    torch.testing.assert_close(out, gate_up_silu_cublas(x, pairs), rtol=2e-2, atol=5e-2)


def test_decode_matmul_modes_agree():
    from hybridflow.engine.kernels.gemm import gate_up_silu_cublas, interleave_pairs
    from hybridflow.engine.layers.matmul_choice import DecodeMatmul

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


@pytest.mark.skipif(DEVICE != "cuda", reason="the tuner times CUDA-graph replays")
def test_decode_matmul_uses_a_pinned_choice_without_timing_and_records_new_ones(tmp_path):
    """A second DecodeMatmul reading the first one's pinned choices (as a later process does,
    through the same file) runs the same kernel without timing anything."""
    from hybridflow.engine.choices import PinnedChoices
    from hybridflow.engine.kernels.launch import launch_for
    from hybridflow.engine.layers.matmul_choice import DecodeMatmul

    x = torch.randn(256, 256, device=DEVICE, dtype=torch.bfloat16)
    pairs = torch.randn(1024, 256, device=DEVICE, dtype=torch.bfloat16)
    launch = launch_for(x.device)
    first = DecodeMatmul("auto", pinned=PinnedChoices(tmp_path / "c.json", {"m": 1}))
    expected = first.gate_up_silu(x, pairs, launch)
    assert first.timings and first.pinned.dirty
    first.pinned.save()
    second = DecodeMatmul("auto", pinned=PinnedChoices(tmp_path / "c.json", {"m": 1}))
    assert torch.equal(second.gate_up_silu(x, pairs, launch), expected)
    assert second.timings == {} and second.choices == first.choices
    with pytest.raises(ValueError, match="decode matmul mode"):
        DecodeMatmul("fast")
