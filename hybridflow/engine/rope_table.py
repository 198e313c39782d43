"""The rotary embedding's cos/sin per cache position, computed once per cache: the prefill
and extend passes (prefill.py) and the decode layers (layers/) read rows of it."""

from __future__ import annotations

import torch

from hybridflow.models.rope import rope_cos_sin


class RopeTable:
    """cos/sin [max_seq_len, head_dim] in the model dtype: the same values rope_cos_sin gives
    for each position, computed once instead of every step."""

    def __init__(self, config, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        positions = torch.arange(max_seq_len, device=device)
        self.cos, self.sin = rope_cos_sin(config, positions, dtype)
