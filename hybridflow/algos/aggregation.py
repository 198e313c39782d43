"""Reduce a per-token loss matrix to the scalar that is back-propagated.

Micro-batching and data parallelism
-----------------------------------
A mini-batch is usually cut into micro-batches (gradient accumulation) and spread over
data-parallel ranks. A plain mean per micro-batch would weight tokens by how the batch
happened to be cut. To make the accumulated gradient equal the one-batch gradient, pass
the counts of the *whole* mini-batch:

- ``global_token_count``: valid tokens (``mask == 1``) in the whole mini-batch, summed
  over all micro-batches and all data-parallel ranks (``token-mean``).
- ``global_seq_count``: sequences with at least one valid token in the whole mini-batch,
  over all micro-batches and ranks (the three ``seq-mean-*`` modes).
- ``norm_length``: the constant ``T`` of ``seq-mean-token-sum-norm``; pass the configured
  max response length, since micro-batches may be padded to different widths.

With global counts, the loss of one micro-batch is already its exact share of the
mini-batch loss. **The training engine must then add, not average:** call ``backward()``
on each micro-batch loss as returned (no division by the number of micro-batches), and
*sum* gradients over data-parallel ranks. DDP/FSDP average gradients over the world size
``W``; to undo that, multiply each micro-batch loss by ``W`` before ``backward()``.
The sum of the returned micro-batch losses over micro-batches and ranks equals the
mini-batch loss (use that for logging).

Without global counts every mode is the plain local mean, which is right for a single
un-split batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algos.masked import masked_fill_zero

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    global_token_count: int | float | Tensor | None = None,
    global_seq_count: int | float | Tensor | None = None,
    norm_length: int | float | None = None,
) -> Tensor:
    """Aggregate ``loss_mat [B, T]`` over the valid positions of ``mask [B, T]``.

    Modes (``L`` the loss, ``m`` the mask, ``N_tok`` / ``N_seq`` the global counts):
    - ``token-mean``:              ``sum L m / N_tok``
    - ``seq-mean-token-sum``:      ``sum_i (sum_t L m) / N_seq``
    - ``seq-mean-token-mean``:     ``sum_i (sum_t L m / sum_t m) / N_seq``
    - ``seq-mean-token-sum-norm``: ``sum_i (sum_t L m / T) / N_seq``  (Dr. GRPO: every
      token weighs ``1/T`` with ``T`` a constant, so length does not rescale the gradient;
      the ``1/N_seq`` keeps the loss scale independent of the batch size, as in the paper's
      ``1/G``.)
    Sequences without any valid token count for nothing. Returns a 0-d tensor.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(
            f"loss_mat and mask must have the same shape, got {tuple(loss_mat.shape)} "
            f"and {tuple(mask.shape)}"
        )
    valid = mask.bool()
    token_losses = masked_fill_zero(loss_mat, valid)
    if mode == "token-mean":
        tokens = valid.sum() if global_token_count is None else global_token_count
        return token_losses.sum() / _as_denominator(tokens, loss_mat)

    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")
    if loss_mat.dim() != 2:
        raise ValueError(f"{mode} needs a [B, T] loss matrix, got {tuple(loss_mat.shape)}")
    tokens_per_seq = valid.sum(-1).to(loss_mat.dtype)  # [B]
    seq_sums = token_losses.sum(-1)  # [B]
    if mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    elif mode == "seq-mean-token-mean":
        seq_losses = seq_sums / tokens_per_seq.clamp(min=1)
    else:  # seq-mean-token-sum-norm
        seq_losses = seq_sums / (loss_mat.shape[-1] if norm_length is None else norm_length)
    seqs = (tokens_per_seq > 0).sum() if global_seq_count is None else global_seq_count
    return seq_losses.sum() / _as_denominator(seqs, loss_mat)


def _as_denominator(count: int | float | Tensor, like: Tensor) -> Tensor:
    """A count as a tensor of ``like``'s dtype/device, at least 1 (no 0/0 on empty batches)."""
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)
