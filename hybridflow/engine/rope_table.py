"""The rotary embedding's cos/sin per cache position, computed once per cache: the prefill
and extend passes (prefill.py) and the decode layers (layers/) read rows of it."""

from __future__ import annotations

import torch

from hybridflow.models.rope import rope_cos_sin


class RopeTable:
    """cos/sin [max_seq_len, head_dim] in the model dtype: the same values rope_cos_sin gives
    for each position, computed once instead of every step.

    slot_shift [slots + 1] (mRoPE models: ``slots`` given, else None): what a slot's decode
    tokens add to their cache position to get their rotary position (engine/images.py);
    the last entry is the scratch slot's, 0."""

    def __init__(self, config, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                 slots: int | None = None):  # fmt: skip
        positions = torch.arange(max_seq_len, device=device)
        self.cos, self.sin = rope_cos_sin(config, positions, dtype)
        self.slot_shift = None
        if slots is not None:
            self.slot_shift = torch.zeros(slots + 1, dtype=torch.long, device=device)

    def rotary_positions(self, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Decode rows' rotary positions [B] from their cache positions and slots [B]."""
        if self.slot_shift is None:
            return positions
        return positions + self.slot_shift[slots]
