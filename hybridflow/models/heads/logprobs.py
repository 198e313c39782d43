"""Log-probabilities and entropy of target tokens from final hidden states, in token chunks.

A full fp32 [N, V] logits tensor for N = 16k tokens and V = 152k is 10 GB; here at most one
[chunk_size, V] block exists at a time, in forward and (recomputed) in backward.

Per token, with logits l = (h @ W.T) / temperature, p = softmax(l), lse = logsumexp(l):
    logprob = l[target] - lse
    entropy = lse - sum_j p_j l_j
    d logprob / d l = onehot(target) - p
    d entropy / d l = -p * (log p + entropy)
"""

from __future__ import annotations

import os

import torch

from hybridflow.models.heads.fused_head import fused_logprobs


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 4096,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [N, H], lm_head_weight [V, H], targets [N] -> (logprobs [N] fp32, entropy [N] fp32
    or None). Differentiable w.r.t. hidden and lm_head_weight (gradients equal the naive
    log_softmax computation up to float rounding).

    fused: tiles over tokens and vocabulary, no [chunk_size, V] logits block
    (models/heads/fused_head.py, with its own tile sizes); off: the token-chunked path below (one
    [chunk_size, V] block at a time)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, H] and targets [N], got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if fused:
        logprobs, entropy = fused_logprobs(
            hidden, lm_head_weight, targets, temperature=temperature, with_entropy=with_entropy,
            kernels=_use_kernels(hidden),
        )  # fmt: skip
        return logprobs, (entropy if with_entropy else None)
    logprobs, entropy = _ChunkedLogprobs.apply(
        hidden, lm_head_weight, targets, float(temperature), bool(with_entropy), int(chunk_size),
        _use_kernels(hidden),
    )  # fmt: skip
    return logprobs, (entropy if with_entropy else None)


def _use_kernels(hidden: torch.Tensor) -> bool:
    """The Triton statistics/gradient kernels (logprob_kernels.py) for half-precision logits
    on CUDA (or under TRITON_INTERPRET=1, for the CPU tests); the torch path otherwise."""
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _chunk_stats(h, weight, targets, temperature, with_entropy):
    """fp32 logits of one chunk and its per-token statistics."""
    logits = h @ weight.T  # [C, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logits, lse, logprobs, entropy


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk_size, kernels):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n if kernels else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            if kernels:  # half-precision logits read once; lse kept for the backward
                from hybridflow.models.heads import logprob_kernels

                chunk_lse, chunk_logprobs, chunk_entropy = logprob_kernels.chunk_stats(
                    hidden[start:stop] @ weight.T, targets[start:stop], temperature, with_entropy
                )
                lse[start:stop] = chunk_lse
            else:
                _, _, chunk_logprobs, chunk_entropy = _chunk_stats(
                    hidden[start:stop], weight, targets[start:stop], temperature, with_entropy
                )
            logprobs[start:stop] = chunk_logprobs
            if with_entropy:
                entropy[start:stop] = chunk_entropy
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.config = (temperature, with_entropy, chunk_size, kernels)
        ctx.mark_non_differentiable(targets)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, saved_lse, saved_entropy = ctx.saved_tensors
        temperature, with_entropy, chunk_size, kernels = ctx.config
        use_entropy = with_entropy and grad_entropy is not None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 accumulation over chunks: bf16 would drop the small late contributions.
        grad_weight = (
            torch.zeros(
                weight.shape,
                dtype=torch.promote_types(weight.dtype, torch.float32),
                device=weight.device,
            )
            if ctx.needs_input_grad[1]
            else None
        )
        n = hidden.shape[0]
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            h = hidden[start:stop]
            chunk_targets = targets[start:stop]
            if kernels:
                from hybridflow.models.heads import logprob_kernels

                grad_logits = logprob_kernels.chunk_grad_(
                    h @ weight.T, chunk_targets, saved_lse[start:stop],
                    saved_entropy[start:stop] if use_entropy else None,
                    grad_logprobs[start:stop] if grad_logprobs is not None
                    else torch.zeros(stop - start, device=h.device),
                    grad_entropy[start:stop] if use_entropy else None, temperature,
                )  # fmt: skip
                if grad_hidden is not None:
                    grad_hidden[start:stop] = grad_logits @ weight
                if grad_weight is not None:
                    grad_weight += grad_logits.T @ h
                continue
            logits, lse, _, _ = _chunk_stats(h, weight, chunk_targets, temperature, False)
            # In-place arithmetic keeps at most two fp32 [C, V] blocks alive.
            logp_all = logits.sub_(lse[:, None])  # [C, V] log p
            probs = logp_all.exp()
            if grad_logprobs is None:
                g_logprob = torch.zeros(stop - start, dtype=logits.dtype, device=h.device)
            else:
                g_logprob = grad_logprobs[start:stop].to(logits.dtype)
            if use_entropy:
                entropy = -(probs * logp_all).sum(-1)
                # coefficient = g_logprob + g_entropy * (log p + entropy), per element
                coefficient = logp_all.add_(entropy[:, None])
                coefficient.mul_(grad_entropy[start:stop, None].to(logits.dtype)).add_(
                    g_logprob[:, None]
                )
                grad_logits = probs.mul_(coefficient).neg_()
            else:
                grad_logits = probs.mul_(-g_logprob[:, None])
            grad_logits.scatter_add_(-1, chunk_targets[:, None], g_logprob[:, None])
            if temperature != 1.0:
                grad_logits /= temperature
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def naive_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (full [N, V] tensor): (logprobs [N], entropy [N]), fp32 or wider."""
    logits = hidden @ lm_head_weight.T
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets[:, None]).squeeze(-1), entropy
