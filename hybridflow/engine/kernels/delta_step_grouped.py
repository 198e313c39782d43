"""Gated DeltaNet's decode step in one Triton kernel, the layout before kernels/delta_step.py
(kept for benchmarks/delta_step.py to time against it): the causal conv's shift and the gated
delta rule's update of every row of a batch, on the per-slot states in place (CUDA; on CPU
under TRITON_INTERPRET=1 in tests). The projections around it (in_proj_qkv, the gates, the
gated norm and out_proj) stay the model's own modules.

Per row b and key head h (one program each), with s = the row's slot:

    window = [conv[s], mixed[b]]  (its channels: q and k of key head h, v of the value heads
    h*G .. h*G+G-1 that key head serves); conv[s'] = window[1:]  (s' = the slot written:
    the row's own, or the scratch slot for a finished row, whose state must not move)
    q, k = l2norm(silu(conv(window))) of the key head; v = silu(conv(window)) per value head
    S = exp(g) S;  S += k (beta (v - k^T S))^T;  out = S^T q / sqrt(Dk)   (S [Dk, Dv] fp32)

A program owns every channel it reads and writes (q and k are read by the G value heads of
their key head only), so no program reads a state another one writes. The state is walked in
[Dk, BLOCK_V] tiles. Rounding follows the torch op (GatedDeltaNet.decode) within a step of
the model dtype: the conv (summed in fp32) and its SiLU rounded to it, the delta rule in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.kernels.delta_step import conv_channels
from hybridflow.models.mixers.gated_delta_rule import L2_EPS


@triton.jit
def _delta_step_kernel(
    mixed_ptr, conv_ptr, weight_ptr, ssm_ptr, g_ptr, beta_ptr, read_ptr, write_ptr, out_ptr,
    stride_m, stride_cs, stride_ss, stride_g, stride_b, stride_o, key_total, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, KERNEL: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    src = tl.load(read_ptr + row).to(tl.int64)
    dst = tl.load(write_ptr + row).to(tl.int64)
    dk = tl.arange(0, BLOCK_K)
    mask_k = dk < DK
    q = conv_channels(mixed_ptr, conv_ptr, weight_ptr, src, dst, row, head * DK + dk, mask_k,
                       stride_m, stride_cs, KERNEL)  # fmt: skip
    k = conv_channels(mixed_ptr, conv_ptr, weight_ptr, src, dst, row,
                       key_total + head * DK + dk, mask_k, stride_m, stride_cs, KERNEL)  # fmt: skip
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    dv = tl.arange(0, BLOCK_V)
    for member in tl.static_range(GROUP):
        value_head = head * GROUP + member
        decay = tl.exp(tl.load(g_ptr + row * stride_g + value_head).to(tl.float32))
        beta = tl.load(beta_ptr + row * stride_b + value_head).to(tl.float32)
        for start in tl.static_range(0, DV, BLOCK_V):
            cols = start + dv
            mask_v = cols < DV
            channels = 2 * key_total + value_head * DV + cols
            v = conv_channels(mixed_ptr, conv_ptr, weight_ptr, src, dst, row, channels, mask_v,
                               stride_m, stride_cs, KERNEL)  # fmt: skip
            tile = value_head * DK * DV + dk[:, None] * DV + cols[None, :]
            mask = mask_k[:, None] & mask_v[None, :]
            state = tl.load(ssm_ptr + src * stride_ss + tile, mask=mask, other=0.0) * decay
            predicted = tl.sum(k[:, None] * state, axis=0)
            state += k[:, None] * (beta * (v - predicted))[None, :]
            tl.store(ssm_ptr + dst * stride_ss + tile, state, mask=mask)
            out = tl.sum(q[:, None] * state, axis=0)
            tl.store(out_ptr + row * stride_o + value_head * DV + cols, out, mask=mask_v)


def delta_rule_step(
    mixed: torch.Tensor,
    conv: torch.Tensor,
    conv_weight: torch.Tensor,
    ssm: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    key_heads: int,
) -> torch.Tensor:
    """One decode token of B rows through a Gated DeltaNet layer's conv and delta rule.

    mixed [B, C] (in_proj_qkv's output), conv [slots, C, K-1] and ssm [slots, Hv, Dk, Dv]
    fp32 (one layer's states, updated in place), conv_weight [C, 1, K], g/beta [B, Hv],
    read_slots/write_slots [B] int64 (the state each row reads and the one it writes) ->
    out [B, Hv, Dv] fp32 (before the gated norm)."""
    rows, channels = mixed.shape
    _, heads, dk, dv = ssm.shape
    kernel = conv_weight.shape[-1]
    assert conv.is_contiguous() and ssm.is_contiguous() and channels == conv.shape[1]
    out = torch.empty(rows, heads, dv, dtype=torch.float32, device=mixed.device)
    if rows == 0:
        return out
    mixed, g, beta = mixed.contiguous(), g.contiguous(), beta.contiguous()
    weight = conv_weight.reshape(channels, kernel).contiguous()
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 4096 // block_k))
    _delta_step_kernel[(rows, key_heads)](
        mixed, conv, weight, ssm, g, beta, read_slots, write_slots, out,
        mixed.stride(0), conv.stride(0), ssm.stride(0), g.stride(0), beta.stride(0),
        out.stride(0), key_heads * dk, dk**-0.5, L2_EPS,
        DK=dk, DV=dv, GROUP=heads // key_heads, KERNEL=kernel, BLOCK_K=block_k, BLOCK_V=block_v,
    )  # fmt: skip
    return out
