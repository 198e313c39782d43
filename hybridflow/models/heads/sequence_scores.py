"""Sequence-classification checkpoints (reward models): where the score head is, and one
score per sequence.

A ``*ForSequenceClassification`` checkpoint is the decoder plus ``score.weight``
[num_labels, H] in place of ``lm_head``; transformers reads the head at each sequence's last
token that is not the pad token. Llama, Mistral and Qwen2/3 run in our decoder
(``CausalLM(config, num_labels)``); other architectures through transformers'
``AutoModelForSequenceClassification`` (:class:`HFSequenceClassifier`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def last_token_index(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, pad_token_id: int | None
) -> torch.Tensor:
    """Packed index [S] of each sequence's rightmost token that is not ``pad_token_id`` (its
    first token when all are pads, as transformers' argmax gives); the last token when
    ``pad_token_id`` is None. input_ids [N], cu_seqlens [S+1]."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()  # [S]
    if pad_token_id is None:
        return ends - 1
    positions = torch.arange(input_ids.shape[0], device=input_ids.device)  # [N]
    sequence = torch.bucketize(positions, ends, right=True)  # [N] which sequence each token is
    keep = input_ids != pad_token_id
    candidate = torch.where(keep, positions, -1)
    last = torch.full_like(starts, -1).scatter_reduce(0, sequence, candidate, "amax")
    return torch.where(last >= 0, last, starts)


def score_head_labels(model_dir: str | Path) -> int | None:
    """Rows of ``score.weight`` in the checkpoint's safetensors headers (no weights read);
    None when there is no score head (a causal LM) or the headers cannot be read."""
    from hybridflow.config.reward_checks import stored_score_rows

    return stored_score_rows(model_dir)


class HFSequenceClassifier(nn.Module):
    """transformers' AutoModelForSequenceClassification behind ``forward_scores`` (re-pads the
    packed sequences, right padding; transformers pools at the last non-pad token)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model
        self.config = hf_model.config

    def forward_scores(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
        if pad_token_id is None:  # transformers cannot batch without a pad id: one at a time
            return torch.cat([
                self.hf_model(input_ids=input_ids[int(a):int(b)][None]).logits.float()
                for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])
            ])  # fmt: skip
        columns = torch.arange(int(max_seqlen), device=input_ids.device)
        valid = columns[None, :] < lengths[:, None]  # [S, T]
        padded = torch.full(valid.shape, pad_token_id, dtype=input_ids.dtype,
                            device=input_ids.device)  # fmt: skip
        padded[valid] = input_ids
        return self.hf_model(input_ids=padded, attention_mask=valid.long()).logits.float()


def pad_token_of(model: nn.Module) -> int | None:
    """The pad id the model's config.json names (the pooling skips trailing pads)."""
    config = model.config
    value = getattr(config, "pad_token_id", None)
    return int(value) if isinstance(value, int) else None
