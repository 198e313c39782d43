"""Speculative decoding at validate: models with recurrent layers (Gated DeltaNet) or sliding
layers' rings pass (their states are rolled back), as drafts too; a draft model must exist and
be one the engine runs, refused naming the key otherwise, and may pad its embedding table to another size than the model's; a draft
whose tokenizer's vocabulary differs from the model's is warned of in one line."""

import json

import pytest

from hybridflow.config import ConfigError, load_config, speculative_checks, validate
from hybridflow.config.model_facts import model_has_recurrent_layers
from hybridflow.config.speculative_checks import tokenizer_vocabulary
from hybridflow.models.presets import PRESETS


def test_recurrent_layers_are_read_off_presets_and_config_json(tmp_path):
    assert model_has_recurrent_layers("tiny-hybrid") is True
    assert model_has_recurrent_layers("tiny") is False
    assert model_has_recurrent_layers("tiny-gpt-oss") is False
    hybrid = PRESETS["tiny-hybrid"].to_hf()
    (tmp_path / "config.json").write_text(json.dumps(hybrid))
    assert model_has_recurrent_layers(str(tmp_path)) is True
    (tmp_path / "config.json").write_text(json.dumps({**hybrid, "layer_types": None}))
    assert model_has_recurrent_layers(str(tmp_path)) is True  # the family's default layers
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf()))
    assert model_has_recurrent_layers(str(tmp_path)) is False


@pytest.mark.parametrize("model", ["tiny-hybrid", "tiny-gpt-oss"])
def test_speculative_decoding_of_models_with_per_sequence_state_validates(model):
    """Recurrent states and sliding rings are rolled back (engine/speculative/rollback.py)."""
    validate(load_config(None, [f"model.path={model}", "rollout.engine.speculative=ngram"]))


def _draft(path, *more):
    return load_config(None, ["rollout.engine.speculative=draft",
                              f"rollout.engine.speculative_draft_model={path}", *more])  # fmt: skip


def _model_dir(path, vocab_size=128, tokens=None):
    """A model directory: the tiny preset's config.json at `vocab_size`, and a tokenizer.json
    of `tokens` (token -> id) if given."""
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({**PRESETS["tiny"].to_hf(), "vocab_size": vocab_size})
    )
    if tokens is not None:
        tokenizer = {"model": {"type": "BPE", "vocab": tokens}, "added_tokens": []}
        (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(path)


def test_a_draft_model_must_exist(tmp_path):
    validate(_draft("tiny-4l"))  # the tiny presets share the char tokenizer's vocabulary
    with pytest.raises(ConfigError, match="neither a preset nor a directory holding config.json"):
        validate(_draft(str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="speculative='draft' needs speculative_draft_model"):
        validate(load_config(None, ["rollout.engine.speculative=draft"]))


@pytest.mark.parametrize("draft", ["tiny-hybrid", "tiny-gpt-oss"])
def test_a_draft_with_recurrent_states_or_a_ring_validates(draft, tmp_path):
    validate(_draft(draft))
    (tmp_path / "config.json").write_text(json.dumps(PRESETS[draft].to_hf()))
    validate(_draft(str(tmp_path)))


def test_a_vision_language_draft_is_refused_naming_what_to_set(tmp_path):
    expected = ("rollout.engine.speculative_draft_model='tiny-vl': a vision-language model "
                "cannot draft.*set rollout.engine.speculative=ngram")  # fmt: skip
    with pytest.raises(ConfigError, match=expected):
        validate(_draft("tiny-vl"))
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny-vl"].to_hf()))
    with pytest.raises(ConfigError, match="a vision-language model cannot draft"):
        validate(_draft(str(tmp_path)))


@pytest.mark.parametrize("vocab_size", [160, 96])
def test_a_draft_with_a_table_of_another_size_validates(tmp_path, vocab_size, caplog):
    """One tokenizer, embedding tables padded to different sizes (Qwen2.5-0.5B's 151,936
    rows beside Qwen2.5-7B's 152,064): the engine cuts or pads the draft's logits."""
    tokens = {"a": 0, "b": 1}
    model = _model_dir(tmp_path / "model", 128, tokens)
    validate(_draft(_model_dir(tmp_path / "draft", vocab_size, tokens), f"model.path={model}"))
    validate(_draft(_model_dir(tmp_path / "untokenized", vocab_size)))  # against a preset
    assert not [r for r in caplog.records if r.name == "hybridflow.config"]


def test_a_draft_whose_tokenizer_differs_is_warned_of_in_one_line(tmp_path, caplog):
    model = _model_dir(tmp_path / "model", tokens={"a": 0, "b": 1})
    draft = _model_dir(tmp_path / "draft", tokens={"a": 0, "c": 1})
    validate(_draft(draft, f"model.path={model}"))
    [record] = [r for r in caplog.records if r.name == "hybridflow.config"]
    message = record.getMessage()
    assert record.levelname == "WARNING" and "\n" not in message
    assert "its tokenizer's vocabulary differs from the model's" in message and draft in message
    assert "the measured rule turns speculation off" in message


def test_tokenizer_vocabularies_are_read_from_tokenizer_json_or_vocab_json(tmp_path, monkeypatch):
    bpe = {"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 2, "content": "<s>"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(bpe))
    assert tokenizer_vocabulary(str(tmp_path)) == {"a": 0, "b": 1, "<s>": 2}
    unigram = {"model": {"vocab": [["x", -1.0], ["y", -2.0]]}, "added_tokens": []}
    (tmp_path / "tokenizer.json").write_text(json.dumps(unigram))
    assert tokenizer_vocabulary(str(tmp_path)) == {"x": 0, "y": 1}
    (tmp_path / "tokenizer.json").write_text("{not json")  # unreadable: vocab.json, else none
    assert tokenizer_vocabulary(str(tmp_path)) is None
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0}))
    assert tokenizer_vocabulary(str(tmp_path)) == {"a": 0}
    assert tokenizer_vocabulary(str(tmp_path / "missing")) is None
    monkeypatch.setattr(speculative_checks, "TOKENIZER_READ_BYTES", 4)  # larger: not read
    assert tokenizer_vocabulary(str(tmp_path)) is None
