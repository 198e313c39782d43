"""Speculative decoding needs a model whose every layer can roll back rejected drafts: one
with recurrent layers (Gated DeltaNet) is refused at validate, naming the key."""

import json

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.model_facts import model_has_recurrent_layers
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
