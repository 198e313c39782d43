"""Skinny matmuls for decode: y = x @ W^T (+ bias), x [M, K] with M = decode rows (<= ~1024),
optionally with x = silu(gate) * up computed while loading (the MLP's down projection, so the
[M, I] product is never written and its kernel never launched).

Why: at M = 256 cuBLAS often picks few thread blocks or split-K plus a separate reduce kernel
for these shapes (~20% of HBM bandwidth measured on an H200, hybridflow/engine/NOTES.md).
A Triton kernel with small M tiles and the M tiles of one weight tile adjacent in launch order
(they share it through L2) is tried against cuBLAS once per (M bucket, N, K, kind) on the
device, and the faster one is kept (`DecodeMatmul`): a shape where cuBLAS wins stays on cuBLAS.

Measured on an H200 (NOTES.md, run 4): this kernel loses to cuBLAS at every decode shape of
qwen2.5-0.5b/1.5b, by 1.3x (o_proj) to 6x (down_proj with the fused SiLU*up, which every N
tile recomputes), so the engine's default is cuBLAS. Kept as the base for a split-K version
and for "auto" on other shapes; the timing method (eager do_bench) also charges Triton's
host launch cost, which CUDA graphs would hide (see NOTES.md).

Rounding follows the torch ops replaced: fp32 accumulation, the bias added before the single
rounding to the output dtype, silu(gate) rounded to the activation dtype before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.forward import _cublas_linear as _cublas


@triton.jit
def _skinny_matmul_kernel(
    a_ptr, up_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_um, stride_wn, stride_cm,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c[m, n] = sum_k a[m, k] * w[n, k] (+ bias[n]); with SILU_MUL, a = silu(a) * up."""
    # M tiles vary fastest: the blocks that read one weight tile run at the same time.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    rm_safe = tl.where(m_mask, rm, 0).to(tl.int64)  # unmasked loads stay in bounds
    rn_safe = tl.where(n_mask, rn, 0).to(tl.int64)
    a_rows = a_ptr + rm_safe[:, None] * stride_am
    u_rows = up_ptr + rm_safe[:, None] * stride_um
    w_cols = w_ptr + rn_safe[None, :] * stride_wn
    dtype = c_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            a = tl.load(a_rows + kk[None, :])
            w = tl.load(w_cols + kk[:, None])  # [BLOCK_K, BLOCK_N]
        else:
            k_mask = kk < K
            a = tl.load(a_rows + kk[None, :], mask=k_mask[None, :], other=0.0)
            w = tl.load(w_cols + kk[:, None], mask=k_mask[:, None], other=0.0)
        if SILU_MUL:
            if EVEN_K:
                u = tl.load(u_rows + kk[None, :]).to(tl.float32)
            else:
                u = tl.load(u_rows + kk[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
            g = a.to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch rounds silu first
            a = (silu * u).to(dtype)
        if FP32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn_safe, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rm_safe[:, None] * stride_cm + rn_safe[None, :]
    tl.store(c, acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Small tiles first: at M <= 256 the
# weights (not the FLOPs) bound the time, and more blocks keep more loads in flight.
CONFIGS = [
    (16, 64, 128, 4, 4),
    (32, 64, 128, 4, 4),
    (64, 32, 128, 4, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 3),
]
INTERPRETER_CONFIG = (16, 32, 32, 4, 1)


def skinny_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    config: tuple = CONFIGS[1],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (rows may be strided), weight [N, K] contiguous, bias [N] -> [M, N].
    With `up` [M, K]: computes (silu(x) * up) @ weight^T (x, up may be halves of one row)."""
    rows, depth = x.shape
    cols = weight.shape[0]
    assert weight.shape[1] == depth and weight.stride(1) == 1 and x.stride(1) == 1
    if out is None:
        out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = config
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    upper = up if up is not None else x
    _skinny_matmul_kernel[grid](
        x, upper, weight, bias if bias is not None else weight, out, rows, cols, depth,
        x.stride(0), upper.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=up is not None, EVEN_K=depth % block_k == 0,
        FP32=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------
# Version 2 (run 5): weight tiles read K-contiguous ([BLOCK_N, BLOCK_K], transposed for the
# dot), optional split-K with fp32 partials (reduced by the consumer: the residual add+RMSNorm
# reads the row anyway), and an epilogue that turns interleaved gate/up columns into
# silu(gate) * up, so the MLP's [M, 2I] product is never written.


@triton.jit
def _gemm_nt_kernel(
    a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K_SPLIT, stride_am, stride_wn, stride_cs, stride_cm,
    HAS_BIAS: tl.constexpr, SILU_PAIRS: tl.constexpr, PARTIAL: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c = a @ w^T over k in [pid_k * K_SPLIT, (pid_k + 1) * K_SPLIT) (K_SPLIT % BLOCK_K == 0).

    PARTIAL: store the fp32 sum of this K range at c[pid_k] (split-K; no bias).
    SILU_PAIRS: w's rows are interleaved (gate_0, up_0, gate_1, up_1, ...): store
    silu(gate) * up into c [M, N / 2], rounded like the torch ops (gate and up to the output
    dtype first, then silu, then the product)."""
    # M tiles vary fastest: the blocks that read one weight tile run at the same time and
    # share it through L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    rm_safe = tl.where(m_mask, rm, 0).to(tl.int64)  # unmasked loads stay in bounds
    rn_safe = tl.where(n_mask, rn, 0).to(tl.int64)
    a_ptrs = a_ptr + rm_safe[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        a = tl.load(a_ptrs)
        w = tl.load(w_ptrs)
        if FP32:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PARTIAL:
        c = c_ptr + pid_k * stride_cs + rm_safe[:, None] * stride_cm + rn_safe[None, :]
        tl.store(c, acc, mask=m_mask[:, None] & n_mask[None, :])
        return
    dtype = c_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn_safe, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_PAIRS:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        c = c_ptr + rm_safe[:, None] * stride_cm + cols[None, :]
        tl.store(c, (silu * up).to(dtype), mask=m_mask[:, None] & (cols < N // 2)[None, :])
    else:
        c = c_ptr + rm_safe[:, None] * stride_cm + rn_safe[None, :]
        tl.store(c, acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def interleave_pairs(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[I, K] gate and up weights -> [2I, K] rows gate_0, up_0, gate_1, up_1, ... (the layout
    gemm_nt(silu_pairs=True) expects)."""
    return torch.stack([gate, up], dim=1).flatten(0, 1)


def gemm_nt(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple,
    splits: int = 1,
    silu_pairs: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (rows may be strided) @ weight [N, K]^T (+ bias).

    splits > 1: returns fp32 partial sums [splits, M, N] (K divided evenly; no bias; the caller
    reduces them). silu_pairs: weight rows interleaved gate/up (interleave_pairs), returns
    silu(gate) * up [M, N / 2]. config: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    rows, depth = x.shape
    cols = weight.shape[0]
    block_m, block_n, block_k, warps, stages = config
    k_split = depth // splits
    if weight.shape[1] != depth or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("gemm_nt needs x [M, K] and weight [N, K] with contiguous rows")
    if k_split * splits != depth or k_split % block_k:
        raise ValueError(f"K={depth} is not {splits} splits of a multiple of {block_k}")
    if splits > 1 and (bias is not None or silu_pairs):
        raise ValueError("split-K partials carry no bias or SiLU epilogue")
    if out is None:
        if splits > 1:
            out = torch.empty(splits, rows, cols, dtype=torch.float32, device=x.device)
        else:
            out_cols = cols // 2 if silu_pairs else cols
            out = torch.empty(rows, out_cols, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n), splits)
    _gemm_nt_kernel[grid](
        x, weight, bias if bias is not None else weight, out, rows, cols, k_split,
        x.stride(0), weight.stride(0), out.stride(0) if splits > 1 else 0,
        out.stride(-2), HAS_BIAS=bias is not None, SILU_PAIRS=silu_pairs, PARTIAL=splits > 1,
        FP32=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _row_bucket(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


class DecodeMatmul:
    """Per-shape choice between cuBLAS and the Triton kernel's configs, timed on first use.

    mode: "auto" (time cuBLAS and each fitting Triton config at the first call of each
    (row bucket, N, K, kind), keep the fastest), "cublas" (never Triton), "triton" (the fastest
    Triton config, never cuBLAS). Rows above max_rows (prefill) always go to cuBLAS. The
    choice is made outside CUDA-graph capture (the graph warm-up runs each step first); a
    shape first met during capture uses cuBLAS. Under TRITON_INTERPRET (CPU tests) the
    Triton kernel runs with a small fixed tile."""

    def __init__(self, mode: str = "auto", max_rows: int = 1024):
        if mode not in ("auto", "cublas", "triton"):
            raise ValueError(f"decode matmul mode {mode!r} not in auto/cublas/triton")
        self.mode = mode
        self.max_rows = max_rows
        self.choices: dict[tuple, tuple | None] = {}  # None = cuBLAS
        self.timings: dict[tuple, dict] = {}  # key -> {candidate: us}, for the notes

    def linear(self, x, weight, bias=None, up=None) -> torch.Tensor:
        rows = x.shape[0]
        if self.mode == "cublas" or rows > self.max_rows:
            return _cublas(x, weight, bias, up)
        if not x.is_cuda:
            return skinny_matmul(x, weight, bias, up, config=INTERPRETER_CONFIG)
        key = (_row_bucket(rows), weight.shape[0], weight.shape[1], up is not None,
               bias is not None, x.dtype, x.device.index)  # fmt: skip
        if key not in self.choices:
            if torch.cuda.is_current_stream_capturing():
                return _cublas(x, weight, bias, up)
            self.choices[key] = self._choose(key, x, weight, bias, up)
        config = self.choices[key]
        if config is None:
            return _cublas(x, weight, bias, up)
        return skinny_matmul(x, weight, bias, up, config=config)

    def _choose(self, key, x, weight, bias, up) -> tuple | None:
        import triton.testing

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=3, rep=15, return_mode="median") * 1000

        bucket = key[0]
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        times: dict = {}
        if self.mode == "auto":
            times["cublas"] = bench(lambda: _cublas(x, weight, bias, up))
        for config in CONFIGS:
            if config[0] > bucket:
                continue
            try:
                times[config] = bench(lambda c=config: skinny_matmul(x, weight, bias, up, c, out))
            except triton.runtime.errors.OutOfResources:  # fp32 tiles can exceed shared memory
                continue
        self.timings[key[:5]] = {str(k): round(v, 2) for k, v in times.items()}
        best = min(times, key=times.get)
        return None if best == "cublas" else best
