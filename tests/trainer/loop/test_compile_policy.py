"""model.compile's default (compile_policy.py): auto compiles when training on CUDA, not on
the CPU; a set value is kept; anything else is named by validate()."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.trainer.loop.compile_policy import compile_defaults, compile_on


def resolved(overrides, device):
    said = []
    cfg = compile_defaults(load_config(None, overrides), said.append, device=device)
    return cfg.model.compile, said


def test_auto_is_on_for_cuda_and_off_for_cpu():
    assert load_config(None, []).model.compile == "auto"  # the default
    on, said = resolved([], "cuda")
    assert on is True
    assert "model.compile=auto: on" in said[0] and "torch-compile" in said[0]
    assert resolved([], "cpu") == (False, [])  # a CPU run has nothing to decide


def test_a_set_value_is_kept_on_either_device():
    assert resolved(["model.compile=false"], "cuda") == (False, [])
    assert resolved(["model.compile=true"], "cpu") == (True, [])
    assert compile_on(True, "cpu") and not compile_on(False, "cuda")


def test_trainer_device_is_resolved_when_no_device_is_given():
    assert resolved(["trainer.device=cpu"], None) == (False, [])
    cfg = compile_defaults(load_config(None, ["trainer.device=cuda"]), lambda line: None)
    assert cfg.model.compile is True


def test_an_unknown_value_is_named_with_the_choices():
    with pytest.raises(ConfigError, match=r"model.compile = 'yes please' is unknown.*auto"):
        validate(load_config(None, ["model.compile=yes please"]))
