import subprocess
import sys

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.precision_checks import precision_problems


def _problems(overrides, use_critic=False):
    return precision_problems(load_config(None, overrides), use_critic=use_critic)


def test_bf16_is_the_default_and_has_no_problem():
    cfg = load_config(None, [])
    assert (cfg.actor.precision, cfg.critic.precision) == ("bf16", "bf16")
    assert precision_problems(cfg, use_critic=True) == []


def test_an_unknown_precision_or_recipe_names_the_key_and_the_choices():
    (problem,) = _problems(["actor.precision=fp16"])
    assert "actor.precision = 'fp16' is unknown: use bf16 or fp8" in problem
    (problem,) = _problems(["critic.fp8_recipe=blockwise"], use_critic=True)
    assert "critic.fp8_recipe = 'blockwise'" in problem and "rowwise" in problem


def test_fp8_on_the_cpu_is_refused_with_the_fix():
    (problem,) = _problems(["actor.precision=fp8", "trainer.device=cpu"])
    assert "compute capability >= 8.9" in problem and "set actor.precision=bf16" in problem
    # the critic is checked only when the run has one (algorithm.adv_estimator=gae)
    assert _problems(["critic.precision=fp8", "trainer.device=cpu"]) == []
    assert len(_problems(["critic.precision=fp8", "trainer.device=cpu"], use_critic=True)) == 1


def test_fp8_with_tensor_parallelism_is_refused():
    (problem,) = _problems(["actor.precision=fp8", "trainer.device=cuda",
                            "actor.tensor_parallel_size=2"])  # fmt: skip
    assert "actor.tensor_parallel_size = 2 is not supported" in problem
    # the critic inherits the actor's size when its own is unset
    problems = _problems(["critic.precision=fp8", "trainer.device=cuda",
                          "actor.tensor_parallel_size=2"], use_critic=True)  # fmt: skip
    assert any("critic.tensor_parallel_size = 2" in p for p in problems)


def test_validate_reports_the_precision_problem():
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, ["actor.precision=fp8", "trainer.device=cpu"]))
    assert any("actor.precision = fp8" in p for p in error.value.problems)


def test_the_command_line_exits_2_without_a_traceback():
    run = subprocess.run(
        [sys.executable, "-m", "hybridflow", "config", "validate", "actor.precision=fp8",
         "trainer.device=cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "actor.precision = fp8" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr
