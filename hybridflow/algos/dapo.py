"""DAPO extras (Yu et al. 2025) as pure functions: overlong reward shaping.

Dynamic sampling's group filter is :func:`hybridflow.algos.groups.groups_with_signal`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer: int, factor: float = 1.0
) -> Tensor:
    """Soft length penalty added to the score: ``min(-(L - (L_max - B)) / B * factor, 0)``.

    Zero up to ``L_max - B`` tokens, then falling linearly to ``-factor`` at ``L_max``, so
    truncated answers are discouraged without the noise of a hard cut-off.

    Args:
        response_lengths: ``[B]`` valid tokens per response (any numeric dtype).
        max_response_length: ``L_max``.
        buffer: ``B`` in ``(0, L_max]``, the length of the penalty ramp.
        factor: penalty at ``L = L_max``.
    Returns:
        ``[B]`` float32 penalties (<= 0).
    """
    if not 0 < buffer <= max_response_length:
        raise ValueError(
            f"overlong buffer must be in (0, max_response_length={max_response_length}], "
            f"got {buffer}"
        )
    lengths = torch.as_tensor(response_lengths).to(torch.float32)
    excess = lengths - (max_response_length - buffer)
    return torch.clamp(-excess / buffer * factor, max=0.0)
