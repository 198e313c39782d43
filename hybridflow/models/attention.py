"""Causal attention kernels for the padded and the packed (variable-length) forward.

Packed backends, all taking q [N, n_heads, head_dim], k/v [N, n_kv_heads, head_dim] and
cu_seqlens int32 [S+1] (sequence i owns tokens cu_seqlens[i]:cu_seqlens[i+1]):
- "flash_varlen": PyTorch's bundled FlashAttention-2 varlen kernel (aten._flash_attention_*),
  CUDA + fp16/bf16 only. No padding, GQA native. Default on CUDA (the fastest measured:
  docs/performance.md, Training throughput (MFU)).
- "flex": torch flex_attention with a document-causal block mask (compiled kernel).
- "nested": SDPA on a jagged nested tensor.
- "sdpa_loop": one SDPA call per sequence; the CPU path and the reference.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

PACKED_BACKENDS = ("auto", "flash_varlen", "flex", "nested", "sdpa_loop")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Map "auto" to a concrete backend for this device/dtype."""
    if backend not in PACKED_BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {PACKED_BACKENDS}")
    if backend != "auto":
        return backend
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return "flash_varlen"
    return "sdpa_loop"


# ---------------------------------------------------------------------------------------------
# Padded batch [B, T]


def padded_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """q [B, T, nh, hd], k/v [B, T, nkv, hd], attention_mask [B, T] (1 = token) -> [B, T, nh, hd].

    Padding keys are masked out; padding queries attend to themselves only (their outputs are
    garbage but finite, so no NaN leaks into gradients)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
    gqa = q.shape[1] != k.shape[1]
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        seq_len = q.shape[2]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
        allowed = causal & attention_mask.bool()[:, None, None, :]  # [B, 1, T, T]
        allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Packed tokens [N]


def make_packed_attention(
    backend: str,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    num_tokens: int,
    deterministic: bool = True,
) -> Attend:
    """Build the attention function shared by all layers of one packed forward (the flex block
    mask and the per-sequence lengths are computed once here, not once per layer).

    deterministic: the flash backward accumulates dQ in a fixed order (deterministic_kernels;
    its cost: docs/performance.md, "Reproducible runs")."""
    if backend == "flash_varlen":
        return functools.partial(
            flash_varlen_attention,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            deterministic=deterministic,
        )
    if backend == "flex":
        block_mask = document_causal_block_mask(cu_seqlens, num_tokens)
        return functools.partial(flex_packed_attention, block_mask=block_mask)
    if backend == "nested":
        return functools.partial(nested_packed_attention, offsets=cu_seqlens.long())
    if backend == "sdpa_loop":
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        return functools.partial(sdpa_loop_attention, lengths=lengths)
    raise ValueError(f"unknown packed attention backend {backend!r}")


def sdpa_loop_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Reference: causal SDPA on each sequence separately."""
    outputs = []
    for q_i, k_i, v_i in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        q_i, k_i, v_i = (t.transpose(0, 1).unsqueeze(0) for t in (q_i, k_i, v_i))
        out = F.scaled_dot_product_attention(
            q_i, k_i, v_i, is_causal=True, enable_gqa=q_i.shape[1] != k_i.shape[1]
        )
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)


class _FlashVarlen(torch.autograd.Function):
    """FlashAttention-2 varlen forward/backward as shipped inside PyTorch (no flash-attn wheel)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, deterministic, causal=True):
        # Dropout 0: the RNG state this returns is never read, so it is neither saved nor
        # passed on (_flash_backward).
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, causal, False
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen = max_seqlen
        ctx.deterministic = deterministic
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        backward = _deterministic_flash_backward if ctx.deterministic else _flash_backward
        dq, dk, dv = backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.causal
        )
        return dq, dk, dv, None, None, None, None


def _flash_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal=True):
    # With dropout 0 the kernel never reads its RNG state: stand-ins made here, as
    # torch.nn.attention.varlen does, rather than the forward's unused state carried through
    # autograd and the opaque op below.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    m = max_seqlen
    return torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, m, m, 0.0, causal, rng_state, unused
    )


# An opaque op for torch.compile: the global flag it sets cannot be traced into a graph.
@torch.library.custom_op("hybridflow::deterministic_flash_backward", mutates_args=())
def _deterministic_flash_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with deterministic_kernels():
        return _flash_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal)


@_deterministic_flash_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal=True):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def deterministic_kernels():
    """PyTorch's FlashAttention-2 backward takes its `deterministic` switch from the global
    flag only: by default a sequence longer than one key block accumulates dQ with atomics,
    in an order that differs between runs (two fresh 0.5b GRPO runs with 448-token responses
    differed at step 1). Set for this one call, then restored; empty tensors are not filled
    (the flag's other effect, which would cost a memset here and NaNs elsewhere)."""
    was_on, was_warn = (
        torch.are_deterministic_algorithms_enabled(),
        (torch.is_deterministic_algorithms_warn_only_enabled()),
    )
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
        torch.utils.deterministic.fill_uninitialized_memory = was_fill


def flash_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    deterministic: bool = True,
    causal: bool = True,
) -> torch.Tensor:
    """causal=False: each token attends to its whole segment (a vision encoder's windows)."""
    return _FlashVarlen.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens,
        max_seqlen,
        deterministic,
        causal,
    )


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_causal_block_mask(cu_seqlens: torch.Tensor, num_tokens: int):
    """flex_attention BlockMask: token q sees token k iff same sequence and k <= q."""
    from torch.nn.attention.flex_attention import create_block_mask

    positions = torch.arange(num_tokens, device=cu_seqlens.device)
    # Tokens past cu_seqlens[-1] (none in practice) get their own id and stay isolated.
    document_id = torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)

    def document_causal(batch, head, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(
        document_causal, None, None, num_tokens, num_tokens, device=cu_seqlens.device
    )


def flex_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask):
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, N, hd]
    out = _compiled_flex_attention()(
        q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.squeeze(0).transpose(0, 1)


def nested_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """SDPA on jagged nested tensors [S, j, heads, hd] (kv heads repeated: NJT has no GQA)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    q, k, v = (
        torch.nested.nested_tensor_from_jagged(t, offsets=offsets).transpose(1, 2)
        for t in (q, k, v)
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).values()
