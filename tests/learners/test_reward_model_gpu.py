"""The reward model offloaded between uses on a GPU: its weights are in host memory before and
after each call, the GPU memory it took is given back, and its scores are those it gives when
it stays on the GPU.

    python -m pytest -m gpu tests/learners/test_reward_model_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from reward_model_helpers import write_reward_model
from test_reward_model import policy_batch

from hybridflow.learners.reward_model import RewardModelScorer
from hybridflow.models import load_tokenizer
from hybridflow.models.checkpoint_io.sequence_classifier import load_sequence_classifier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_offloaded_weights_are_on_the_gpu_only_while_it_scores(tmp_path):
    tokenizer = load_tokenizer("char")
    directory = write_reward_model(tmp_path / "rm", "llama", tokenizer=tokenizer)
    batch = policy_batch(tokenizer)
    resident = RewardModelScorer(load_sequence_classifier(str(directory)), device="cuda")
    expected = resident.compute_rm_scores(batch).tensors["rm_scores"]
    del resident
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    scorer = RewardModelScorer(load_sequence_classifier(str(directory)), device="cuda",
                               offload=True)  # fmt: skip
    assert all(p.device.type == "cpu" for p in scorer.model.parameters())
    assert torch.cuda.memory_allocated() == before
    torch.cuda.reset_peak_memory_stats()
    scores = scorer.compute_rm_scores(batch).tensors["rm_scores"]
    weights = sum(p.numel() * p.element_size() for p in scorer.model.parameters())
    assert torch.cuda.max_memory_allocated() >= before + weights  # it scored on the GPU
    assert all(p.device.type == "cpu" for p in scorer.model.parameters())
    assert torch.cuda.memory_allocated() == before
    torch.testing.assert_close(scores, expected)
