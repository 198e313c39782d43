"""Gated DeltaNet's decode step in Triton: the conv shift, the gates, the gated delta rule on
the per-slot states in place, and the output's gated RMSNorm (CUDA; on CPU under
TRITON_INTERPRET=1 in tests). The projections around it (in_proj_qkv, in_proj_a/b/z,
out_proj) stay the model's own modules.

The step is bound by the [Hv, Dk, Dv] fp32 state (2 MiB a row at Qwen3.5's 32 x 128 x 128),
read once and written once. Two launches:

1. ``_qk_kernel``, a program per (row, key head): q and k of the head = l2norm(silu(conv)) of
   their channels, the conv state of those channels shifted; q (scaled by 1/sqrt(Dk)) and k
   to a [B, 2 * Hk * Dk] fp32 buffer (8 MiB at 256 rows: it stays in L2 for step 2).
2. ``_state_kernel``, a program per (row, value head, tile of block_v value columns): its v
   columns' conv (their conv state shifted too), the decay exp(-exp(A_log) * softplus(a +
   dt_bias)) and beta = sigmoid(b), then the [Dk, block_v] tile of the state: read, decayed,
   corrected by the delta rule, written, and the output columns S^T q. A program that holds
   a whole value head (block_v >= Dv) also applies the gated norm and writes the model-dtype
   output; with narrower tiles (the default: DeltaStepLaunch says why) ``_norm_kernel`` does
   it after, a third launch over the [B, Hv * Dv] fp32 output (the norm sums over Dv).

Why q/k first: each key head's q and k are read by G value heads x Dv/block_v programs. If
every one of them convolved q/k, one of them would have to shift the q/k conv state in place
while the others still read it; the small first launch owns those channels instead, so no
program reads a state that another program writes. Each state tile is an independent load ->
reduce -> store of a [Dk, block_v] fp32 block with no loop around it, so the grid (rows x Hv x
tiles: 8192 programs or more at 256 rows) keeps enough loads in flight to stream HBM.

Rounding follows the torch op (GatedDeltaNet.decode, then GatedDeltaNet.output) within a
step of the model dtype: the conv (summed in fp32) and its SiLU rounded to it, beta rounded to
it, the delta rule in fp32, the core rounded to the model dtype before the norm. Rows are
expected to write distinct slots, except the scratch slot (finished and padding rows), whose
contents are never read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridflow.models.mixers.gated_delta_rule import L2_EPS


@dataclass(frozen=True)
class DeltaStepLaunch:
    """Launch parameters (benchmarks/delta_step.py sweeps them). block_v: value columns of
    a state tile (None: the whole head, which also fuses the gated norm); num_warps: the state
    kernel's (None: 8 for a tile of more than 8k elements, else 4).

    The default, [128, 64] tiles on 4 warps at Dk = 128, is the widest that ptxas fits in
    registers for sm_90a: 168 a thread, no spills, 3 programs an SM; the whole head ([128,
    128]) takes 255 and spills on 8 warps (and on 4), [128, 32] on 4 warps 96."""

    block_v: int | None = 64
    num_warps: int | None = None


@dataclass(frozen=True)
class DeltaParams:
    """A Gated DeltaNet layer's parameters the step reads: the depthwise conv taps [C, K],
    A_log and dt_bias [Hv], the gated norm's weight [Dv] and epsilon, the key heads."""

    conv_weight: torch.Tensor
    A_log: torch.Tensor  # noqa: N815 (HF's name)
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    key_heads: int

    @classmethod
    def of(cls, mixer) -> DeltaParams:
        """Of a models/mixers/gated_deltanet.GatedDeltaNet (views, no copies)."""
        weight = mixer.conv1d.weight
        return cls(weight.reshape(weight.shape[0], weight.shape[-1]), mixer.A_log,
                   mixer.dt_bias, mixer.norm.weight, mixer.norm.eps, mixer.num_k_heads)  # fmt: skip


@triton.jit
def conv_channels(mixed_ptr, conv_ptr, weight_ptr, src, dst, row, channels, mask, stride_m,
                   stride_cs, KERNEL: tl.constexpr):  # fmt: skip
    """silu(conv) of `channels` of one row (fp32, rounded to the model dtype like the torch
    op), the conv state shifted by the row's new input into slot dst."""
    dtype = mixed_ptr.dtype.element_ty
    newest = tl.load(mixed_ptr + row * stride_m + channels, mask=mask, other=0.0)
    acc = newest.to(tl.float32) * tl.load(weight_ptr + channels * KERNEL + KERNEL - 1, mask=mask,
                                          other=0.0).to(dtype).to(tl.float32)  # fmt: skip
    state = conv_ptr + channels * (KERNEL - 1)
    for j in tl.static_range(KERNEL - 1):
        old = tl.load(state + src * stride_cs + j, mask=mask, other=0.0).to(dtype)
        tap = tl.load(weight_ptr + channels * KERNEL + j, mask=mask, other=0.0).to(dtype)
        acc += old.to(tl.float32) * tap.to(tl.float32)
    tl.debug_barrier()
    # the shift: entry j takes entry j + 1, read before the next iteration overwrites it (a
    # thread stores the channels it loaded, so in place, src == dst, reads the old values)
    for j in tl.static_range(KERNEL - 2):
        later = tl.load(state + src * stride_cs + j + 1, mask=mask, other=0.0)
        tl.store(state + dst * stride_cs + j, later, mask=mask)
    if KERNEL > 1:
        tl.store(state + dst * stride_cs + KERNEL - 2, newest.to(conv_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    convolved = acc.to(dtype).to(tl.float32)
    return (convolved * tl.sigmoid(convolved)).to(dtype).to(tl.float32)


@triton.jit
def _qk_kernel(mixed_ptr, conv_ptr, weight_ptr, read_ptr, write_ptr, qk_ptr, stride_m,
               stride_cs, stride_qk, key_total, scale, eps, DK: tl.constexpr,
               KERNEL: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    src = tl.load(read_ptr + row).to(tl.int64)
    dst = tl.load(write_ptr + row).to(tl.int64)
    dk = tl.arange(0, BLOCK_K)
    mask = dk < DK
    q = conv_channels(mixed_ptr, conv_ptr, weight_ptr, src, dst, row, head * DK + dk, mask,
                       stride_m, stride_cs, KERNEL)  # fmt: skip
    k = conv_channels(mixed_ptr, conv_ptr, weight_ptr, src, dst, row, key_total + head * DK + dk,
                       mask, stride_m, stride_cs, KERNEL)  # fmt: skip
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    tl.store(qk_ptr + row * stride_qk + head * DK + dk, q, mask=mask)
    tl.store(qk_ptr + row * stride_qk + key_total + head * DK + dk, k, mask=mask)


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20): log1p(exp(x)), log1p as log(u) * t / (u - 1) so a
    tiny exp(x) keeps its precision (Goldberg's trick; Triton has no log1p everywhere)."""
    t = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + t
    grown = tl.where(u == 1.0, 1.0, u - 1.0)  # no 0 / 0 in the branch not taken
    small = tl.where(u == 1.0, t, tl.log(u) * (t / grown))
    return tl.where(x > 20.0, x, small)


@triton.jit
def _gated_norm(core, cols, mask, z_ptr, norm_w_ptr, norm_eps, DV: tl.constexpr):
    """GatedRMSNorm of one value head's core [BLOCK_V >= DV] fp32: the core rounded to the
    model dtype (z's), normalised over DV, times the weight (rounded), times silu(z) in fp32."""
    dtype = z_ptr.dtype.element_ty
    x = tl.where(mask, core.to(dtype).to(tl.float32), 0.0)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / DV + norm_eps)).to(dtype).to(tl.float32)
    weight = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(dtype).to(tl.float32)
    z = tl.load(z_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (weight * normed).to(dtype).to(tl.float32) * (z * tl.sigmoid(z))


@triton.jit
def _state_kernel(
    mixed_ptr, conv_ptr, weight_ptr, ssm_ptr, qk_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr,
    read_ptr, write_ptr, z_ptr, norm_w_ptr, out_ptr, stride_m, stride_cs, stride_ss, stride_qk,
    stride_a, stride_b, stride_z, stride_o, key_total, norm_eps, DK: tl.constexpr,
    DV: tl.constexpr, GROUP: tl.constexpr, KERNEL: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    value_head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dk = tl.arange(0, BLOCK_K)
    mask_k, mask_v = dk < DK, cols < DV
    mask = mask_k[:, None] & mask_v[None, :]
    src = tl.load(read_ptr + row).to(tl.int64)
    dst = tl.load(write_ptr + row).to(tl.int64)
    tile = value_head * DK * DV + dk[:, None] * DV + cols[None, :]
    state = tl.load(ssm_ptr + src * stride_ss + tile, mask=mask, other=0.0)  # first: the stream
    key_head = value_head // GROUP
    q = tl.load(qk_ptr + row * stride_qk + key_head * DK + dk, mask=mask_k, other=0.0)
    k = tl.load(qk_ptr + row * stride_qk + key_total + key_head * DK + dk, mask=mask_k, other=0.0)
    v = conv_channels(mixed_ptr, conv_ptr, weight_ptr, src, dst, row,
                       2 * key_total + value_head * DV + cols, mask_v, stride_m, stride_cs,
                       KERNEL)  # fmt: skip
    dtype = mixed_ptr.dtype.element_ty
    a = tl.load(a_ptr + row * stride_a + value_head).to(tl.float32)
    a += tl.load(dt_bias_ptr + value_head).to(tl.float32)
    g = -tl.exp(tl.load(a_log_ptr + value_head).to(tl.float32)) * _softplus(a)
    beta = tl.sigmoid(tl.load(b_ptr + row * stride_b + value_head).to(tl.float32))
    beta = beta.to(dtype).to(tl.float32)  # the model's sigmoid is in its dtype
    state = state * tl.exp(g)
    predicted = tl.sum(k[:, None] * state, axis=0)
    state += k[:, None] * (beta * (v - predicted))[None, :]
    tl.store(ssm_ptr + dst * stride_ss + tile, state, mask=mask)
    core = tl.sum(q[:, None] * state, axis=0)
    out = out_ptr + row * stride_o + value_head * DV + cols
    if NORM:
        z = z_ptr + row * stride_z + value_head * DV
        tl.store(out, _gated_norm(core, cols, mask_v, z, norm_w_ptr, norm_eps, DV), mask=mask_v)
    else:
        tl.store(out, core, mask=mask_v)


@triton.jit
def _norm_kernel(core_ptr, z_ptr, norm_w_ptr, out_ptr, stride_c, stride_z, stride_o, norm_eps,
                 DV: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    value_head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_V)
    mask = cols < DV
    core = tl.load(core_ptr + row * stride_c + value_head * DV + cols, mask=mask, other=0.0)
    z = z_ptr + row * stride_z + value_head * DV
    out = _gated_norm(core, cols, mask, z, norm_w_ptr, norm_eps, DV)
    tl.store(out_ptr + row * stride_o + value_head * DV + cols, out, mask=mask)


def state_tile(dk: int, dv: int, launch: DeltaStepLaunch) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, num_warps) of the state kernel."""
    block_k, whole = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    block_v = (
        whole if launch.block_v is None else min(triton.next_power_of_2(launch.block_v), whole)
    )
    # H100 80GB, qwen3.5-4b's heads at 256 rows (benchmarks/delta_step.py): [128, 64] tiles
    # took 461.5 us on 2 warps, 478.0 on 4; [128, 128] 463.8 on 4, 576.4 on 8, 3,191 on 2
    warps = launch.num_warps or (4 if block_k * block_v > 8192 else 2)
    return block_k, block_v, warps


def gated_delta_step(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    params: DeltaParams,
    launch: DeltaStepLaunch = DeltaStepLaunch(),
) -> torch.Tensor:
    """One decode token of B rows through a Gated DeltaNet layer, between its projections.

    mixed [B, C] (in_proj_qkv's output), a/b [B, Hv] (in_proj_a/in_proj_b's, before their
    gates), z [B, Hv * Dv] (in_proj_z's); conv [slots, C, K-1] and ssm [slots, Hv, Dk, Dv]
    fp32 (one layer's states, updated in place); read_slots/write_slots [B] (the state each
    row reads and the one it writes) -> [B, Hv * Dv] in mixed's dtype: the gated norm's
    output, out_proj's input."""
    rows, channels = mixed.shape
    _, heads, dk, dv = ssm.shape
    kernel = params.conv_weight.shape[-1]
    key_heads = params.key_heads
    assert conv.is_contiguous() and ssm.is_contiguous() and channels == conv.shape[1]
    assert params.conv_weight.is_contiguous() and z.stride(-1) == 1
    out = torch.empty(rows, heads * dv, dtype=mixed.dtype, device=mixed.device)
    if rows == 0:
        return out
    mixed, a, b = mixed.contiguous(), a.contiguous(), b.contiguous()
    key_total = key_heads * dk
    qk = torch.empty(rows, 2 * key_total, dtype=torch.float32, device=mixed.device)
    block_k, block_v, warps = state_tile(dk, dv, launch)
    _qk_kernel[(rows, key_heads)](
        mixed, conv, params.conv_weight, read_slots, write_slots, qk, mixed.stride(0),
        conv.stride(0), qk.stride(0), key_total, dk**-0.5, L2_EPS,
        DK=dk, KERNEL=kernel, BLOCK_K=block_k,
    )  # fmt: skip
    fused = block_v >= dv
    core = out if fused else torch.empty(rows, heads * dv, dtype=torch.float32, device=out.device)
    _state_kernel[(rows, heads, triton.cdiv(dv, block_v))](
        mixed, conv, params.conv_weight, ssm, qk, a, b, params.A_log, params.dt_bias,
        read_slots, write_slots, z, params.norm_weight, core, mixed.stride(0), conv.stride(0),
        ssm.stride(0), qk.stride(0), a.stride(0), b.stride(0), z.stride(0), core.stride(0),
        key_total, params.norm_eps,
        DK=dk, DV=dv, GROUP=heads // key_heads, KERNEL=kernel, BLOCK_K=block_k,
        BLOCK_V=block_v, NORM=fused, num_warps=warps,
    )  # fmt: skip
    if not fused:
        _norm_kernel[(rows, heads)](
            core, z, params.norm_weight, out, core.stride(0), z.stride(0), out.stride(0),
            params.norm_eps, DV=dv, BLOCK_V=triton.next_power_of_2(dv),
        )  # fmt: skip
    return out
