"""What a sequence mixer is told about its tokens (TokenLayout) and the per-head weights it mixes
with (HeadWeights): shared by the one-process layer (mixers/gated_deltanet.py) and its
sequence- and tensor-parallel splits (models/sharding/deltanet_parallel.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.models.mixers.gated_delta_rule import rows_of_packed


@dataclass(frozen=True)
class TokenLayout:
    """How the tokens of a forward are laid out, for mixers that run along each sequence.

    Packed: x is [N, H], sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1]; ``columns`` [N]
    is each token's index inside its sequence. Padded: x is [B, T, H] and attention_mask
    [B, T] (1 = token; None = no padding)."""

    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    columns: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    sequence_group: object | None = None
    """Ulysses (models/sharding/sequence_parallel.py): x is this rank's contiguous slice of
    the packed stream that cu_seqlens describes (a torch.distributed ProcessGroup)."""

    @classmethod
    def packed(
        cls, cu_seqlens: torch.Tensor, max_seqlen: int, sequence_group: object | None = None
    ) -> TokenLayout:
        columns = rows_of_packed(cu_seqlens, int(max_seqlen))[1]
        return cls(cu_seqlens=cu_seqlens, max_seqlen=int(max_seqlen), columns=columns,
                   sequence_group=sequence_group)  # fmt: skip

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None


@dataclass(frozen=True)
class HeadWeights:
    """The per-head weights of some of a layer's heads (all of them, or a sequence- or
    tensor-parallel rank's): ``conv`` [C', 1, K] the conv taps of their q, k and v channels
    (in that order), ``A_log`` and ``dt_bias`` [Hv'] their decay."""

    conv: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
