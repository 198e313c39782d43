"""The sequence-classification variant of our decoder (reward models): the score of each
packed sequence equals transformers' ``*ForSequenceClassification`` forward of it."""

from __future__ import annotations

import pytest
import torch
from reward_model_helpers import write_reward_model

from hybridflow.models.checkpoint_io.sequence_classifier import load_sequence_classifier
from hybridflow.models.heads.sequence_scores import (
    HFSequenceClassifier,
    last_token_index,
    score_head_labels,
)

SEQUENCES = [[3, 17, 40, 41, 9, 4], [3, 22, 5], [3, 8, 8, 30, 4, 0, 0]]  # the last ends in pads


def packed(sequences):
    input_ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    lengths = torch.tensor([0] + [len(s) for s in sequences])
    return input_ids, positions, lengths.cumsum(0).to(torch.int32), max(map(len, sequences))


def test_last_token_index_skips_trailing_pads_as_transformers_does():
    input_ids, _, cu_seqlens, _ = packed([[5, 6, 0], [0, 0], [7]])
    # [5 6 0 | 0 0 | 7]: the 6 at 1; no real token -> the first (3); the 7 at 5
    assert last_token_index(input_ids, cu_seqlens, 0).tolist() == [1, 3, 5]
    assert last_token_index(input_ids, cu_seqlens, None).tolist() == [2, 4, 5]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_packed_scores_equal_transformers(tmp_path, family):
    from transformers import AutoModelForSequenceClassification

    directory = write_reward_model(tmp_path / family, family)
    assert score_head_labels(directory) == 1
    model = load_sequence_classifier(str(directory))
    assert type(model).__name__ == "CausalLM" and model.lm_head is None
    reference = AutoModelForSequenceClassification.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        ours = model.forward_scores(*packed(SEQUENCES), pad_token_id=0)[:, 0]
        theirs = [float(reference(input_ids=torch.tensor([s])).logits[0, 0]) for s in SEQUENCES]
        through_hf = HFSequenceClassifier(reference).forward_scores(*packed(SEQUENCES), 0)
    torch.testing.assert_close(ours, torch.tensor(theirs), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(through_hf[:, 0], torch.tensor(theirs), atol=1e-4, rtol=1e-4)
    assert len({round(v, 3) for v in theirs}) == 3  # continuous scores, not a constant


def test_a_causal_lm_has_no_score_head(tmp_path):
    from model_helpers import small_config

    from hybridflow.models import build_model

    build_model(small_config("llama")).save_pretrained(str(tmp_path))
    assert score_head_labels(tmp_path) is None
    with pytest.raises(ValueError, match="score.weight"):
        load_sequence_classifier(str(tmp_path))


def test_an_architecture_outside_our_decoder_scores_through_transformers(tmp_path, capsys):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        num_labels=1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    reference = GPT2ForSequenceClassification(config).eval()
    reference.save_pretrained(str(tmp_path))
    model = load_sequence_classifier(str(tmp_path))
    assert isinstance(model, HFSequenceClassifier)
    assert "through transformers" in capsys.readouterr().err
    with torch.no_grad():
        ours = model.forward_scores(*packed(SEQUENCES), pad_token_id=0)[:, 0]
        theirs = [float(reference(input_ids=torch.tensor([s])).logits[0, 0]) for s in SEQUENCES]
    torch.testing.assert_close(ours, torch.tensor(theirs), atol=1e-4, rtol=1e-4)


def test_a_built_reward_model_saves_as_transformers_names_it(tmp_path):
    """build_model(num_labels=1): a random reward model of a preset's shape (benchmarks),
    saved as a *ForSequenceClassification checkpoint that transformers scores as we do."""
    from model_helpers import small_config
    from transformers import AutoModelForSequenceClassification

    from hybridflow.models import build_model

    build_model(small_config("qwen2"), num_labels=1).save_pretrained(str(tmp_path))
    reference = AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).eval()
    assert type(reference).__name__ == "Qwen2ForSequenceClassification"
    ours = load_sequence_classifier(str(tmp_path))
    sequence = SEQUENCES[0]
    with torch.no_grad():
        theirs = float(reference(input_ids=torch.tensor([sequence])).logits[0, 0])
        mine = ours.forward_scores(*packed([sequence]), pad_token_id=None)[0, 0]
    assert abs(float(mine) - theirs) < 1e-4
