"""Between token ids and reward text: decoding responses, placing scores on tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def place_scores(
    scores: Sequence[float] | torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Put each sequence's score on its last valid response token.

    Args:
        scores: [B] one score per response.
        response_mask: [B, R] 1 on response tokens (right-padded; gaps allowed).
    Returns:
        token_level_scores [B, R] float32, zero everywhere except the last token where
        `response_mask` is 1. A response with no valid token gets no score (nothing to credit).
    """
    scores = torch.as_tensor(scores, dtype=torch.float32, device=response_mask.device)  # [B]
    if scores.shape != response_mask.shape[:1]:
        raise ValueError(
            f"scores {tuple(scores.shape)} do not match response_mask rows {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()  # [B, R]
    positions = torch.arange(mask.shape[1], device=mask.device)  # [R]
    last = torch.where(mask, positions, -1).amax(dim=1)  # [B], -1 when empty
    token_level_scores = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    token_level_scores[rows, last[rows]] = scores[rows]
    return token_level_scores


def decode_responses(tokenizer, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Text of each response's valid tokens ([B, R] ids and mask), special tokens skipped."""
    texts = []
    for ids, mask in zip(responses.tolist(), response_mask.bool().tolist()):
        valid = [token for token, keep in zip(ids, mask) if keep]
        texts.append(tokenizer.decode(valid, skip_special_tokens=True))
    return texts
