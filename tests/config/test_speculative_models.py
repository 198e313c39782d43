"""Speculative decoding at validate: models with recurrent layers (Gated DeltaNet) or sliding
layers' rings pass (their states are rolled back); a draft model must exist and share the
model's vocabulary, refused naming the key otherwise."""

import json

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.model_facts import model_has_recurrent_layers
from hybridflow.config.speculative_checks import model_vocab_size
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
