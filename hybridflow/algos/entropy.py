"""Token entropy from logits in row chunks, so the fp32 ``[tokens, vocab]`` softmax is
never materialised for the whole batch at once (a 152k vocabulary is 0.6 MB per token).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _entropy_rows(logits: Tensor) -> Tensor:
    """``H = logsumexp(z) - sum softmax(z) z`` in fp32, for ``logits [N, V]`` -> ``[N]``."""
    logits = logits.float()
    log_normaliser = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return log_normaliser - (probs * logits).sum(-1)


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of the softmax over the last dim: ``logits [..., V]`` -> ``[...]`` fp32.

    Works on ``chunk_size`` rows at a time. When a gradient is needed each chunk is
    recomputed in the backward pass (activation checkpointing), so the autograd graph
    also holds one chunk's softmax at a time, not the whole batch's.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    leading_shape = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    needs_grad = torch.is_grad_enabled() and rows.requires_grad
    chunks = []
    for chunk in rows.split(chunk_size):
        if needs_grad and rows.shape[0] > chunk_size:
            chunks.append(checkpoint(_entropy_rows, chunk, use_reentrant=False))
        else:
            chunks.append(_entropy_rows(chunk))
    if not chunks:
        return torch.zeros(leading_shape, dtype=torch.float32, device=logits.device)
    return torch.cat(chunks).reshape(leading_shape)
