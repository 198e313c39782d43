"""The fused log-prob head: lm_head matmul, log-softmax, the target's log-prob and the
entropy, forward and backward, in tiles of tokens x vocabulary; no [N, V] logits ever exist.

- forward: an online log-sum-exp over vocabulary tiles keeps, per token, the running max,
  sum of exp, sum of exp * logit and the target's logit (Milakov & Gimelshein 2018, "Online
  normalizer calculation for softmax"); on CUDA the tiles live in the kernel's registers
  (fused_head_kernels.py), on the CPU (and in fp32/fp64) the same algorithm runs in torch
  with one [token_chunk, vocab_chunk] block at a time.
- backward: each tile's logits are recomputed and turned into d loss / d logits (one
  [token_chunk, vocab_chunk] block), then dh += g @ W_tile and dW_tile += g^T @ h.

Formulas (l = logits / T): logprob = l[target] - lse, entropy = lse - sum_j p_j l_j,
d/dl = g_logprob (onehot(target) - p) - g_entropy p (log p + entropy).
"""

from __future__ import annotations

import torch

TOKEN_CHUNK = 8192
"""Tokens per backward block (and per CPU forward block). The fp32 lm_head gradient is read
and written once per block: 5 GB per block at Llama-3.1-8B's head, so fewer, larger blocks."""
VOCAB_CHUNK = 8192
"""Vocabulary entries per backward block: a bf16 [8192, 8192] gradient block is 128 MB, where
the token-chunked head's [4096, vocabulary] logits block is 1.2 GB at a 152k vocabulary."""


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    kernels: bool,
    token_chunk: int = TOKEN_CHUNK,
    vocab_chunk: int = VOCAB_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], weight [V, H], targets [N] -> (logprobs [N], entropy [N]) fp32 (entropy
    zeros unless with_entropy); differentiable w.r.t. hidden and weight. kernels: the Triton
    path (CUDA half precision, or TRITON_INTERPRET=1)."""
    return _FusedLogprobs.apply(
        hidden, weight, targets, float(temperature), bool(with_entropy), bool(kernels),
        int(token_chunk), int(vocab_chunk),
    )  # fmt: skip


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def merge_partials(
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    part_weighted: torch.Tensor,
    part_target: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partials [S, N] of S vocabulary slices (max m, sum exp(l - m), sum exp(l - m) l, the
    target logit or 0 where the target is in another slice) -> (lse, logprob, entropy) [N]."""
    top = part_max.max(0).values  # [N]
    rescale = torch.exp(part_max - top)  # [S, N]
    total = (part_sum * rescale).sum(0)
    lse = top + torch.log(total)
    entropy = lse - (part_weighted * rescale).sum(0) / total
    return lse, part_target.sum(0) - lse, entropy


def _torch_partials(h, weight, targets, temperature, vocab_chunk):
    """The kernel's forward in torch: one slice per vocab_chunk, stacked [S, C]."""
    maxima, sums, weighted, target_logits = [], [], [], []
    for v0 in range(0, weight.shape[0], vocab_chunk):
        logits = (h @ weight[v0 : v0 + vocab_chunk].T).to(_accumulate_dtype(h.dtype))
        logits = logits / temperature  # [C, Vc]
        top = logits.max(-1).values
        e = torch.exp(logits - top[:, None])
        maxima.append(top)
        sums.append(e.sum(-1))
        weighted.append((e * logits).sum(-1))
        local = targets - v0
        inside = (local >= 0) & (local < logits.shape[1])
        picked = logits.gather(-1, local.clamp(0, logits.shape[1] - 1)[:, None]).squeeze(-1)
        target_logits.append(torch.where(inside, picked, torch.zeros_like(picked)))
    return [torch.stack(x) for x in (maxima, sums, weighted, target_logits)]


def _torch_grad_block(h, w_tile, local_targets, lse, entropy, g_logprob, g_entropy,
                      temperature):  # fmt: skip
    """d loss / d logits of one [C, Vc] block in torch (the kernel's backward)."""
    logits = (h @ w_tile.T).to(lse.dtype) / temperature
    log_p = logits - lse[:, None]
    p = log_p.exp()
    if g_entropy is not None:
        grad = -p * (g_logprob[:, None] + g_entropy[:, None] * (log_p + entropy[:, None]))
    else:
        grad = -p * g_logprob[:, None]
    hit = local_targets[:, None] == torch.arange(logits.shape[1], device=h.device)[None, :]
    grad = torch.where(hit, grad + g_logprob[:, None], grad)
    return (grad / temperature).to(h.dtype)


def _statistics(hidden, weight, targets, temperature, with_entropy, kernels, token_chunk,
                vocab_chunk):  # fmt: skip
    """(lse, logprobs, entropy) [N] of the whole head, fp32 (or wider on the torch path)."""
    if hidden.shape[0] == 0:
        empty = torch.zeros(0, dtype=_accumulate_dtype(hidden.dtype), device=hidden.device)
        return empty, empty, empty
    if kernels:
        from hybridflow.models.heads import fused_head_kernels

        partials = fused_head_kernels.forward_partials(
            hidden, weight, targets, temperature, with_entropy
        )
        return merge_partials(*partials)
    pieces = []
    for s in range(0, hidden.shape[0], token_chunk):
        rows = slice(s, s + token_chunk)
        partials = _torch_partials(hidden[rows], weight, targets[rows], temperature, vocab_chunk)
        pieces.append(merge_partials(*partials))
    return tuple(torch.cat(x) for x in zip(*pieces))


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, kernels,
                token_chunk, vocab_chunk):  # fmt: skip
        if kernels:  # the kernels read rows with unit stride
            hidden, weight = hidden.contiguous(), weight.contiguous()
        lse, logprobs, entropy = _statistics(hidden, weight, targets, temperature, with_entropy,
                                             kernels, token_chunk, vocab_chunk)  # fmt: skip
        if not with_entropy:
            entropy = torch.zeros_like(entropy)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.config = (temperature, with_entropy, kernels, token_chunk, vocab_chunk)
        ctx.mark_non_differentiable(targets)
        return logprobs.float(), entropy.float()

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, with_entropy, kernels, token_chunk, vocab_chunk = ctx.config
        use_entropy = with_entropy and grad_entropy is not None
        n, vocab = hidden.shape[0], weight.shape[0]
        accumulate = _accumulate_dtype(hidden.dtype)
        g_logprob = (
            grad_logprobs.to(accumulate) if grad_logprobs is not None
            else torch.zeros(n, dtype=accumulate, device=hidden.device)
        )  # fmt: skip
        g_entropy = grad_entropy.to(accumulate) if use_entropy else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 sums over blocks: bf16 would drop the small late contributions.
        grad_weight = (
            torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
            if ctx.needs_input_grad[1] else None
        )  # fmt: skip
        block = (
            torch.empty(min(token_chunk, n), min(vocab_chunk, vocab), dtype=hidden.dtype,
                        device=hidden.device)
            if kernels else None
        )  # fmt: skip
        for s in range(0, n, token_chunk):
            h = hidden[s : s + token_chunk]
            rows = slice(s, s + h.shape[0])
            grad_h = torch.zeros(h.shape, dtype=accumulate, device=h.device)
            for v0 in range(0, vocab, vocab_chunk):
                w_tile = weight[v0 : v0 + vocab_chunk]
                local = targets[rows] - v0
                ent = entropy[rows] if use_entropy else None
                g_ent = g_entropy[rows] if use_entropy else None
                if kernels:
                    from hybridflow.models.heads import fused_head_kernels

                    grad = fused_head_kernels.grad_tile(
                        h, w_tile, local, lse[rows], ent, g_logprob[rows], g_ent, temperature,
                        block[: h.shape[0], : w_tile.shape[0]],
                    )  # fmt: skip
                else:
                    grad = _torch_grad_block(
                        h, w_tile, local, lse[rows], ent, g_logprob[rows], g_ent, temperature
                    )
                if grad_hidden is not None:
                    grad_h += grad @ w_tile
                if grad_weight is not None:
                    grad_weight[v0 : v0 + vocab_chunk] += grad.T @ h
            if grad_hidden is not None:
                grad_hidden[rows] = grad_h.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None
