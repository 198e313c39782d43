"""Speculative decoding needs a model whose every layer can roll back rejected drafts: one
with recurrent layers (Gated DeltaNet) or sliding layers' rings is refused at validate,
naming the key; a draft model must exist and share the model's vocabulary."""

import json

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.model_facts import model_has_recurrent_layers
from hybridflow.config.speculative_checks import model_has_windowed_layers, model_vocab_size
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


def test_speculative_decoding_of_a_recurrent_model_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout.engine.speculative = 'ngram': the model "
                                          r"'tiny-hybrid' has recurrent layers"):  # fmt: skip
        validate(load_config("examples/hybrid.yaml", ["rollout.engine.speculative=ngram"]))
    validate(load_config(None, ["rollout.engine.speculative=ngram"]))  # attention only: runs


def test_speculative_decoding_of_a_windowed_model_is_refused(tmp_path):
    assert model_has_windowed_layers("tiny-gpt-oss") is True
    assert model_has_windowed_layers("tiny") is False
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny-gpt-oss"].to_hf()))
    assert model_has_windowed_layers(str(tmp_path)) is True
    with pytest.raises(ConfigError, match="'tiny-gpt-oss' has sliding layers"):
        validate(load_config(None, ["model.path=tiny-gpt-oss", "rollout.engine.speculative=ngram"]))


def test_a_draft_model_must_exist_and_share_the_vocabulary(tmp_path):
    def draft(path):
        return load_config(None, ["rollout.engine.speculative=draft",
                                  f"rollout.engine.speculative_draft_model={path}"])  # fmt: skip

    validate(draft("tiny-4l"))  # the tiny presets share the char tokenizer's vocabulary
    with pytest.raises(ConfigError, match="neither a preset nor a directory holding config.json"):
        validate(draft(str(tmp_path / "missing")))
    wide = {**PRESETS["tiny"].to_hf(), "vocab_size": 160}
    (tmp_path / "config.json").write_text(json.dumps(wide))
    assert model_vocab_size(str(tmp_path)) == 160 and model_vocab_size("tiny") == 128
    with pytest.raises(ConfigError, match="its vocabulary has 160 tokens, the model 'tiny-4l' 128"):
        validate(draft(str(tmp_path)))
    with pytest.raises(ConfigError, match="speculative='draft' needs speculative_draft_model"):
        validate(load_config(None, ["rollout.engine.speculative=draft"]))
