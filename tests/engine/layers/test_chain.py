"""The five-launch decode layer's matmuls (chain.py) against the split path's ops: RMSNorm in
the matmul's prologue, residual add + sums of squares in its epilogue, the in-kernel split-K
reduction. CUDA (marked gpu) or CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine.kernels import (
    gemm,  # noqa: E402
    rowwise,
)
from hybridflow.engine.layers import chain as chain_mod  # noqa: E402


class _Norm:
    def __init__(self, dim):
        self.weight = torch.randn(dim, device=DEVICE)
        self.eps = 1e-6


def _tile():
    # on the GPU a shallow pipeline: the tests run in fp32, where the deep tiles of
    # CHAIN_TILES need more shared memory than an SM has (the tuner skips those)
    return chain_mod.INTERPRETER_PLAN[0] if DEVICE == "cpu" else (64, 32, 64, 4, 3)


@pytest.mark.parametrize("rows", [5, 16, 37])
@pytest.mark.parametrize("silu", [False, True])
def test_norm_linear_equals_rms_norm_then_matmul(rows, silu):
    """Sums of squares in parts (as a residual epilogue leaves them) and the norm weight folded
    into the matmul's weight -> the same result as rowwise.rms_norm (weighted) followed by the
    matmul with the unfolded weight (fp32: up to rounding order)."""
    hidden, cols = 128, 96
    chain = chain_mod.DecodeChain()
    residual = torch.randn(rows, hidden, device=DEVICE) * 3
    norm = _Norm(hidden)
    weight = torch.randn(cols, hidden, device=DEVICE) / hidden**0.5
    bias = None if silu else torch.randn(cols, device=DEVICE)
    sums = chain.sums_buffer(rows, hidden, residual.device)
    parts = 4  # as if a producer with 32-column tiles wrote them
    for j in range(parts):
        block = residual[:, j * 32 : (j + 1) * 32]
        sums[j, :rows] = (block * block).sum(-1)
    sums[parts:].fill_(1e9)  # beyond `parts`: must not be read
    folded = weight * norm.weight[None, :]
    out = chain.norm_linear(residual, (sums, parts), norm.eps, folded, bias, silu_pairs=silu)
    normed = rowwise.rms_norm(residual, norm)
    unweighted = rowwise.rms_norm(residual, norm, weighted=False)
    torch.testing.assert_close(unweighted * norm.weight, normed, rtol=1e-5, atol=1e-5)
    if silu:
        expected = gemm.gate_up_silu_cublas(normed, weight)
    else:
        expected = F.linear(normed, weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [5, 37])
@pytest.mark.parametrize("splits", [1, 2])
def test_residual_linear_updates_stream_and_sums(rows, splits):
    """residual += x @ W^T + b in place, the sums of squares per column tile of the new rows,
    and a K split reduced in the kernel gives the same result as none."""
    hidden, depth = 96, 128
    chain = chain_mod.DecodeChain()
    tile = _tile()
    x = torch.randn(rows, depth, device=DEVICE)
    weight = torch.randn(hidden, depth, device=DEVICE) / depth**0.5
    bias = torch.randn(hidden, device=DEVICE)
    residual = torch.randn(rows, hidden, device=DEVICE)
    expected = residual + F.linear(x, weight, bias)
    key = chain_mod._key("residual", rows, weight)
    chain.plans[key] = (tile, splits)
    sums = chain.sums_buffer(rows, hidden, x.device)
    for _repeat in range(2):  # the split counters reset themselves for the next launch
        updated = residual.clone()
        sums_out, parts = chain.residual_linear(x, weight, bias, updated, (sums, 0))
        torch.testing.assert_close(updated, expected, rtol=1e-5, atol=1e-5)
        assert parts == -(-hidden // tile[1])
        tiles = updated.split(tile[1], dim=1)
        want = torch.stack([(t * t).sum(-1) for t in tiles])
        torch.testing.assert_close(sums_out[:parts, :rows], want, rtol=1e-5, atol=1e-4)
    if splits > 1:
        counts = chain._scratch[(key, tile, splits)][1]
        assert counts.eq(0).all()


def test_chain_applies_up_to_its_row_limit():
    assert chain_mod.DecodeChain(max_rows=16).applies(16)
    assert not chain_mod.DecodeChain(max_rows=16).applies(17)


def test_pinned_tiles_are_used_if_still_candidates():
    """A tile chosen in an earlier process is used without timing while it is a candidate;
    one the tile table no longer has (or a split that does not divide K) is timed again."""
    from hybridflow.engine.choices import PinnedChoices

    key = ("residual", 16, 64, 128, "torch.float32")
    tile = chain_mod.CHAIN_TILES[0]
    assert chain_mod.DecodeChain._known("residual", key, tile, 2)
    assert not chain_mod.DecodeChain._known("residual", key, (1, 2, 3, 4, 5), 1)
    assert not chain_mod.DecodeChain._known("norm", key, tile, 2)  # only residuals split
    assert not chain_mod.DecodeChain._known("residual", key, (64, 64, 128, 4, 4), 2)  # 128*2>K
    pinned = PinnedChoices()
    pinned.put("chain_tile", key, (tile, 2))
    assert pinned.get("chain_tile", key) == (tile, 2)  # JSON lists back to tuples
