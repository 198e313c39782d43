"""A model directory's config.json is read without a traceback, whatever it holds."""

from __future__ import annotations

import re

import pytest

from hybridflow.errors import UserError
from hybridflow.models.hf_checkpoint import read_hf_config
from hybridflow.models.loadability import architecture_problem, config_problems


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
