"""A model directory's config.json is read without a traceback, whatever it holds."""

from __future__ import annotations

import re

import pytest

from hybridflow.errors import UserError
from hybridflow.models.checkpoint_io.hf_checkpoint import read_hf_config
from hybridflow.models.checkpoint_io.loadability import architecture_problem, config_problems


@pytest.mark.parametrize(
    "text, expected",
    [
        ("{", "is not valid JSON (line 1, column 2"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('"qwen2"', "must hold a JSON object, not a str"),
    ],
)
def test_config_json_that_is_not_a_config(tmp_path, text, expected):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(UserError, match=re.escape(expected)):
        read_hf_config(str(tmp_path))
    (problem,) = config_problems(tmp_path)
    assert str(tmp_path / "config.json") in problem and expected.split(" (")[0] in problem


def test_architectures_transformers_builds_are_accepted():
    assert architecture_problem({"model_type": "qwen2"}, "m") is None  # our decoder
    assert architecture_problem({"model_type": "gpt2"}, "m") is None  # transformers'
    assert architecture_problem({"architectures": ["GPT2LMHeadModel"]}, "m") is None


def test_an_architecture_nothing_builds_is_named():
    problem = architecture_problem({"model_type": "florbnet", "architectures": ["Florb"]}, "m")
    assert "model_type 'florbnet'" in problem and "Florb" in problem


def _tiny_dir(path):
    import torch

    from hybridflow.models import build_model
    from hybridflow.models.checkpoint_io.hf_writer import save_model
    from hybridflow.models.presets import preset_config

    save_model(build_model(preset_config("tiny"), dtype=torch.float32), str(path))
    return path


def test_a_tensor_the_model_has_no_place_for_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _tiny_dir(tmp_path)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.0.mlp.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, model / "model.safetensors")
    (problem,) = config_problems(model)
    assert "hold 1 tensors" in problem and "model.layers.0.mlp.extra.weight" in problem


def test_files_the_loader_does_not_read_are_not_checked(tmp_path):
    # Mistral's repositories keep consolidated.safetensors (its own names) beside the shards
    from safetensors.torch import save_file

    model = _tiny_dir(tmp_path)
    save_file({"layers.0.attention.wq.weight": __import__("torch").zeros(2)},
              model / "consolidated.safetensors")  # fmt: skip
    assert config_problems(model) == []


def test_a_config_of_more_layers_is_said_before_a_model_is_built(tmp_path):
    import json

    model = _tiny_dir(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 4096  # the most config.json may name: built, 4096 layers
    (model / "config.json").write_text(json.dumps(config))
    (problem,) = config_problems(model)
    assert "hold 2 decoder layers" in problem and "num_hidden_layers = 4096" in problem


@pytest.mark.parametrize(
    "vision, words",
    [
        ({"out_hidden_size": 48}, "vision_config.out_hidden_size=48 must equal the language "
         "model's hidden_size"),
        ({"fullatt_block_indexes": [7]}, "fullatt_block_indexes [7] are not blocks of depth"),
        ({"window_size": 13}, "vision_config.window_size=13 must be at least"),
    ],
    ids=["encoder-width", "full-attention-block", "window"],
)  # fmt: skip
def test_a_vision_language_config_our_decoder_refuses_is_named_not_passed_to_transformers(
    tmp_path, vision, words
):
    import json

    from hybridflow.model_config_values import ModelConfigError
    from hybridflow.models import load_model
    from hybridflow.models.presets import PRESETS

    config = PRESETS["tiny-vl"].to_hf()  # transformers has no causal LM of it to fall back to
    config["vision_config"] = {**config["vision_config"], **vision}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (problem,) = config_problems(tmp_path)
    assert problem.startswith(f"{tmp_path / 'config.json'}: ") and words in problem
    with pytest.raises(ModelConfigError, match=re.escape(words)):
        load_model(str(tmp_path))


def test_a_model_type_that_is_not_a_string_is_named_not_looked_up():
    problem = architecture_problem({"model_type": ["qwen2"]}, "m")
    assert 'model_type = ["qwen2"]' in problem and "must be strings" in problem


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"hidden_act": "florb"}, "hidden_act = 'florb' is not an activation transformers has"),
        ({"rope_scaling": {"rope_type": "nonsense", "factor": 2.0}},
         "rope_scaling rope_type = 'nonsense' is not a RoPE scaling transformers has"),
    ],
)  # fmt: skip
def test_a_name_transformers_builds_by_and_lacks_is_named_at_validate_and_load(
    tmp_path, changes, named
):
    """Our decoder hands such a model to transformers' fallback, whose build looked the name
    up in a table (a KeyError traceback in serve and train)."""
    import json

    from hybridflow.model_config_values import ModelConfigError
    from hybridflow.models import load_model

    model = _tiny_dir(tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    (problem,) = config_problems(model)
    assert named in problem and str(model / "config.json") in problem
    with pytest.raises(ModelConfigError, match=re.escape(named)):
        load_model(str(model))
