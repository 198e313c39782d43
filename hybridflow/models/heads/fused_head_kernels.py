"""Triton kernels of the fused log-prob head (models/heads/fused_head.py): CUDA, bf16/fp16 hidden
states and lm_head; the CPU tests run them under TRITON_INTERPRET=1.

Each program computes [BLOCK_T, BLOCK_V] logits tiles h @ W^T in registers (fp32
accumulation over the hidden size), so no logits are ever written to memory:

- forward: a program owns BLOCK_T tokens and one split of the vocabulary, walks the split's
  tiles and keeps the running max m, sum s = sum exp(l - m), t = sum exp(l - m) * l and the
  target's logit (online log-sum-exp); the host merges the splits' partials ([splits, N]).
- backward: a program recomputes one tile and writes d loss / d logits of it (the gradient
  tile the host's two matmuls need: dh += g @ W_tile, dW_tile += g^T @ h).

Per token, l = logits / T, lse = logsumexp(l), p = exp(l - lse):
    logprob = l[target] - lse,  entropy = lse - sum_j p_j l_j
    d/dl: g_logprob * (onehot(target) - p) - g_entropy * p * (log p + entropy)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (tokens, vocabulary, hidden) per tile; 8 warps, 3 stages: the tile of the engine's gemm_nt
# that won at prefill sizes on the H200 (engine/layers/matmul_choice.py).
BLOCK_T, BLOCK_V, BLOCK_K = 128, 128, 64
NUM_WARPS, NUM_STAGES = 8, 3


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, N, V, H, stride_h, stride_w, inv_temperature,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):  # fmt: skip
    """fp32 [BLOCK_T, BLOCK_V] = h[rows] @ W[cols]^T * inv_temperature (rows and columns past
    N and V read row 0). EVEN_K: H is a multiple of BLOCK_K, the loads need no mask."""
    rows_safe = tl.where(rows < N, rows, 0).to(tl.int64)
    cols_safe = tl.where(cols < V, cols, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows_safe[:, None] * stride_h + ks[None, :]
    w_ptrs = w_ptr + cols_safe[:, None] * stride_w + ks[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(h_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_mask = (k0 + ks) < H
            a = tl.load(h_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc * inv_temperature


@triton.jit
def _forward_kernel(
    h_ptr, w_ptr, targets_ptr, part_m_ptr, part_s_ptr, part_t_ptr, part_target_ptr,
    N, V, H, stride_h, stride_w, tiles_per_split, num_tiles, inv_temperature,
    WITH_ENTROPY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Program (token block, vocabulary split): the split's partial statistics of its rows,
    stored at part_*[split, row]."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    targets = tl.load(targets_ptr + rows, mask=rows < N, other=-1)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    t = tl.zeros([BLOCK_T], dtype=tl.float32)
    target_logit = tl.zeros([BLOCK_T], dtype=tl.float32)
    first = split * tiles_per_split
    for tile in range(first, tl.minimum(first + tiles_per_split, num_tiles)):
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        z = _logits_tile(h_ptr, w_ptr, rows, cols, N, V, H, stride_h, stride_w,
                         inv_temperature, BLOCK_T, BLOCK_V, BLOCK_K, EVEN_K)  # fmt: skip
        valid = (cols < V)[None, :]
        z = tl.where(valid, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: every tile has a valid column
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        s = s * scale + tl.sum(e, axis=1)
        if WITH_ENTROPY:
            t = t * scale + tl.sum(tl.where(valid, e * z, 0.0), axis=1)
        target_logit += tl.sum(tl.where(cols[None, :] == targets[:, None], z, 0.0), axis=1)
        m = m_new
    out = split.to(tl.int64) * N + rows
    keep = rows < N
    tl.store(part_m_ptr + out, m, mask=keep)
    tl.store(part_s_ptr + out, s, mask=keep)
    tl.store(part_t_ptr + out, t, mask=keep)
    tl.store(part_target_ptr + out, target_logit, mask=keep)


@triton.jit
def _grad_tile_kernel(
    h_ptr, w_ptr, targets_ptr, lse_ptr, entropy_ptr, g_logprob_ptr, g_entropy_ptr, grad_ptr,
    N, V, H, stride_h, stride_w, stride_g, inv_temperature,
    WITH_ENTROPY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """grad [N, V] (h's dtype) = d loss / d logits of h [N, H] @ W [V, H]^T, with targets
    relative to W's first row (outside [0, V): the target is in another tile)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    z = _logits_tile(h_ptr, w_ptr, rows, cols, N, V, H, stride_h, stride_w, inv_temperature,
                     BLOCK_T, BLOCK_V, BLOCK_K, EVEN_K)  # fmt: skip
    keep = rows < N
    log_p = z - tl.load(lse_ptr + rows, mask=keep, other=0.0)[:, None]
    p = tl.exp(log_p)
    g_logprob = tl.load(g_logprob_ptr + rows, mask=keep, other=0.0)[:, None]
    if WITH_ENTROPY:
        entropy = tl.load(entropy_ptr + rows, mask=keep, other=0.0)[:, None]
        g_entropy = tl.load(g_entropy_ptr + rows, mask=keep, other=0.0)[:, None]
        grad = -p * (g_logprob + g_entropy * (log_p + entropy))
    else:
        grad = -p * g_logprob
    targets = tl.load(targets_ptr + rows, mask=keep, other=-1)
    grad = tl.where(cols[None, :] == targets[:, None], grad + g_logprob, grad)
    out = grad_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    mask = keep[:, None] & (cols < V)[None, :]
    tl.store(out, (grad * inv_temperature).to(grad_ptr.dtype.element_ty), mask=mask)


def vocab_splits(token_blocks: int, num_tiles: int, programs: int) -> int:
    """Tiles per vocabulary split so that about ``programs`` programs run (the grid fills
    the GPU when there are few tokens), each split keeping at least one tile."""
    splits = max(1, min(num_tiles, triton.cdiv(programs, token_blocks)))
    return triton.cdiv(num_tiles, splits)


def forward_partials(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """hidden [N, H], weight [V, H] (rows contiguous), targets [N] -> the vocabulary splits'
    (max, sum exp, sum exp * logit, target logit), each fp32 [splits, N]."""
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    assert hidden.stride(1) == 1 and weight.stride(1) == 1
    token_blocks, num_tiles = triton.cdiv(n, BLOCK_T), triton.cdiv(vocab, BLOCK_V)
    sms = (
        torch.cuda.get_device_properties(hidden.device).multi_processor_count
        if hidden.is_cuda
        else 4
    )
    tiles_per_split = vocab_splits(token_blocks, num_tiles, 2 * sms)
    splits = triton.cdiv(num_tiles, tiles_per_split)
    partials = torch.empty(4, splits, n, dtype=torch.float32, device=hidden.device)
    _forward_kernel[(token_blocks, splits)](
        hidden, weight, targets, partials[0], partials[1], partials[2], partials[3],
        n, vocab, hidden_size, hidden.stride(0), weight.stride(0), tiles_per_split, num_tiles,
        1.0 / temperature, WITH_ENTROPY=with_entropy, BLOCK_T=BLOCK_T, BLOCK_V=BLOCK_V,
        BLOCK_K=BLOCK_K, EVEN_K=hidden_size % BLOCK_K == 0, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )  # fmt: skip
    return partials[0], partials[1], partials[2], partials[3]


def grad_tile(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
    entropy: torch.Tensor | None, g_logprob: torch.Tensor, g_entropy: torch.Tensor | None,
    temperature: float, out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """out [N, V] (hidden's dtype, rows contiguous) = d(sum g_logprob * logprob + g_entropy *
    entropy) / d logits of hidden [N, H] @ weight [V, H]^T; targets relative to weight's
    first row. lse, entropy: fp32 [N] from the forward. g_entropy None: no entropy term."""
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    assert hidden.stride(1) == 1 and weight.stride(1) == 1 and out.stride(1) == 1
    with_entropy = g_entropy is not None
    g_logprob = g_logprob.float().contiguous()
    g_entropy = g_entropy.float().contiguous() if with_entropy else g_logprob
    _grad_tile_kernel[(triton.cdiv(n, BLOCK_T), triton.cdiv(vocab, BLOCK_V))](
        hidden, weight, targets, lse, entropy if with_entropy else lse, g_logprob, g_entropy,
        out, n, vocab, hidden_size, hidden.stride(0), weight.stride(0), out.stride(0),
        1.0 / temperature, WITH_ENTROPY=with_entropy, BLOCK_T=BLOCK_T, BLOCK_V=BLOCK_V,
        BLOCK_K=BLOCK_K, EVEN_K=hidden_size % BLOCK_K == 0, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )  # fmt: skip
    return out
