"""A crafted config fails in one line: nesting thousands deep, aliases that expand
exponentially ("billion laughs"), a value that contains itself, keys and values megabytes
long. None of them may reach a RecursionError or run out of memory."""

from __future__ import annotations

import pytest

from hybridflow.cli import main
from hybridflow.config import ConfigError, load_config
from hybridflow.config.verl import load_with_verl_keys

DEEP = "[" * 5000 + "]" * 5000


def billion_laughs() -> str:
    """Nine levels of nine aliases: 9**9 (387 million) strings from 90 lines."""
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for previous, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
    return "\n".join([*lines, "data:", "  train_files: *i"])


FILES = {
    "a list nested 5000 deep": (f"data:\n  train_files: {DEEP}\n", "more than 32 levels deep"),
    "a mapping nested 5000 deep": (
        "data:\n  x: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n",
        "more than 32 levels deep",
    ),
    "billion laughs": (billion_laughs(), "more than 100,000 values once its YAML aliases"),
    "a value containing itself": ("data:\n  train_files: &a [x, *a]\n", "inside the value"),
}


@pytest.mark.parametrize("case", list(FILES))
def test_a_crafted_config_file_is_refused_naming_it(tmp_path, case):
    text, expected = FILES[case]
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected) as error:
        load_config(path)
    assert str(path) in str(error.value)


def test_aliases_within_the_limits_still_work(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_files: &t [builtin:arithmetic]\n  val_files: *t\n")
    assert load_config(path).data.val_files == ["builtin:arithmetic"]


@pytest.mark.parametrize("key", ["data.train_files", "actor_rollout_ref.model.path"])
def test_an_override_value_nested_5000_deep_is_refused_naming_its_key(key):
    with pytest.raises(ConfigError, match="more than 32 levels deep") as error:
        load_with_verl_keys(None, [f"{key}={DEEP}"], log=lambda text: None)
    assert key in str(error.value)


@pytest.mark.parametrize("prefix", ["rollout.", "actor_rollout_ref.", ""])
def test_a_key_thousands_of_parts_long_is_refused_in_a_short_line(prefix):
    key = prefix + ".".join(["ab"] * 20_000)
    with pytest.raises(ConfigError, match="longer than any config key") as error:
        load_with_verl_keys(None, [f"{key}=1"], log=lambda text: None)
    assert len(str(error.value)) < 400


def test_a_huge_value_is_shown_cut_short():
    huge = "[" + ",".join(["1"] * 10_000) + "]"
    with pytest.raises(ConfigError, match="expects int") as error:
        load_config(None, [f"rollout.n={huge}"])
    assert "(20,000 characters)" not in str(error.value) and len(str(error.value)) < 400


def test_the_command_line_exits_2_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(billion_laughs())
    assert main(["config", "validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(path) in err and len(err.splitlines()) == 2


def test_a_checkpoints_config_file_is_read_with_the_same_bounds(tmp_path):
    """config.yaml inside a checkpoint (resume, export) and a run directory's (report) may be
    crafted too: the same bounds hold there, and report skips such a file."""
    from hybridflow.report.runs import read_config as report_config
    from hybridflow.trainer.lifecycle.run_state import check_config_changes, read_run_config

    checkpoint = tmp_path / "checkpoints" / "step_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.yaml").write_text(billion_laughs())
    with pytest.raises(ConfigError, match="more than 100,000 values"):
        read_run_config(checkpoint)
    with pytest.raises(ConfigError, match="more than 100,000 values"):
        check_config_changes(checkpoint, load_config(None, []), log=print)
    (tmp_path / "config.yaml").write_text(billion_laughs())
    assert report_config(tmp_path) is None
