"""The reward model of a checkpoint directory as a scorer: our decoder with a score head
where it runs the architecture, else transformers' sequence classifier."""

from __future__ import annotations

import sys

import torch
from torch import nn

from hybridflow.config.reward_checks import SCORE_WEIGHT
from hybridflow.models.heads.sequence_scores import HFSequenceClassifier, score_head_labels


def load_sequence_classifier(
    path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> nn.Module:
    """The reward model in ``path``: our decoder with a score head when it runs the
    architecture, else transformers' (one line on stderr says so)."""
    from hybridflow.models import native_support_problem
    from hybridflow.models.checkpoint_io.hf_checkpoint import load_model_from_dir, read_hf_config

    num_labels = score_head_labels(path)
    if num_labels is None:
        raise ValueError(f"{path} holds no {SCORE_WEIGHT} (not a sequence-classification model)")
    problem = native_support_problem(read_hf_config(path))
    if problem is None:
        return load_model_from_dir(path, dtype=dtype, device=device, num_labels=num_labels)
    print(f"hybridflow: {path}: {problem}; loading the reward model through transformers",
          file=sys.stderr)  # fmt: skip
    from transformers import AutoModelForSequenceClassification

    from hybridflow.models.checkpoint_io.finite_weights import check_all_finite

    hf_model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa"
    )
    check_all_finite(hf_model.named_parameters(), path)  # buffers may hold -inf masks
    return HFSequenceClassifier(hf_model.to(device))
