import importlib.abc
import subprocess
import sys

import pytest

from hybridflow.cli import build_parser, main

SUBCOMMANDS = ("config", "train", "sft", "export", "data", "bench", "serve", "report")


def test_validate_exit_codes(capsys):
    assert main(["config", "validate"]) == 0
    rc = main(
        [
            "config",
            "validate",
            "data.train_batch_size=60",
            "rollout.n=12",
            "trainer.n_gpus_per_node=64",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "data.train_batch_size" in err and "Traceback" not in err


def test_show_marks_derived(capsys):
    assert main(["config", "show", "rollout.n=4"]) == 0
    out = capsys.readouterr().out
    assert "n: 4" in out
    assert "samples_per_step" in out and "# derived" in out


def test_import_is_light():
    """The CLI starts (help, validate, errors) without the heavy libraries: what it imports,
    not a wall-clock bound, which a loaded CI host would make flaky."""
    code = (
        "import sys; import hybridflow, hybridflow.config, hybridflow.cli; "
        "print(*[m for m in ('torch', 'transformers', 'numpy', 'pyarrow') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], "import hybridflow must not import " + out.stdout


HEAVY_LIBRARIES = ("torch", "transformers", "numpy")


def heavy_imports_of(argv: list[str]) -> tuple[int, list[str]]:
    """(exit status, the heavy libraries loaded) of `hybridflow ARGV` in a new interpreter."""
    code = (
        "import contextlib, io, sys\n"
        "from hybridflow.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        f"        status = main({argv!r})\n"
        "    except SystemExit as exit:\n"
        "        status = exit.code\n"
        f"print(status, *[m for m in {HEAVY_LIBRARIES!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    status, *loaded = out.stdout.split()
    return int(status), loaded


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["config", "show"],
        ["config", "show", "rollout.n=4"],
        ["config", "plan", "trainer.device=cpu"],  # `auto` asks torch whether a GPU is seen
        ["config", "plan", "trainer.device=cpu", "model.path=tiny-hybrid"],  # recurrent state
    ],
)
def test_commands_that_build_no_model_start_without_torch(argv):
    """Every subcommand's parser is built and the config validated without torch (2-3 s of
    CPU a command): what the command imports, not a wall-clock bound, which a loaded CI host
    would make flaky."""
    assert heavy_imports_of(argv) == (0, [])


def test_python_dash_m_runs_the_command():
    # `python -m hybridflow` where the venv's scripts directory is not on PATH
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow", "config", "validate"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "config OK" in done.stdout, done.stdout


class FailingImport(importlib.abc.MetaPathFinder):
    """Makes importing ``module`` fail as if the package ``missing`` were not installed."""

    def __init__(self, module: str, missing: str):
        self.module, self.missing = module, missing

    def find_spec(self, name, path=None, target=None):
        if name == self.module:
            raise ModuleNotFoundError(f"No module named {self.missing!r}", name=self.missing)
        return None


@pytest.fixture
def failing_import(monkeypatch):
    def install(module: str, missing: str) -> None:
        monkeypatch.delitem(sys.modules, module, raising=False)
        monkeypatch.setattr(sys, "meta_path", [FailingImport(module, missing), *sys.meta_path])

    return install


def _listed(parser) -> set[str]:
    return {a for action in parser._subparsers._group_actions for a in action.choices}


def test_every_subcommand_listed():
    assert _listed(build_parser()) == set(SUBCOMMANDS)


@pytest.mark.parametrize(
    "command, module, missing, argv",
    [
        ("data", "hybridflow.data.cli", "pyarrow", ["data", "check", "x.parquet"]),
        ("bench", "hybridflow.bench.cli", "triton", ["bench", "rollout", "--help"]),
    ],
)
def test_subcommand_whose_module_fails_to_import_stays_listed_and_says_why(
    failing_import, capsys, command, module, missing, argv
):
    failing_import(module, missing)
    parser = build_parser()
    assert _listed(parser) == set(SUBCOMMANDS)
    assert "unavailable" in parser.format_help()
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"hybridflow {command}" in err and module in err and f"pip install {missing}" in err


def test_train_whose_module_is_broken_exits_2_naming_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hybridflow.trainer.lifecycle.run", None)  # a broken install
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert (
        "hybridflow.trainer.lifecycle.run" in err and "reinstall" in err and "Traceback" not in err
    )


def test_unknown_arguments_still_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "validate", "--no-such-flag"])
    assert exit_info.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, usage, unknown",
    [
        (["bench", "rollout", "--model", "x"], "usage: hybridflow bench rollout ", "--model x"),
        (["export", "a", "b", "c"], "usage: hybridflow export ", "c"),
        (["--no-such-flag"], "usage: hybridflow [-h]", "--no-such-flag"),
    ],
)
def test_unknown_arguments_are_said_with_the_usage_of_the_command_given(
    capsys, argv, usage, unknown
):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(usage) and f"error: unrecognized arguments: {unknown}\n" in err, err


def test_overrides_after_the_config_option_are_overrides(capsys):
    """`config show --config FILE key=value`: argparse leaves the overrides after the option
    unassigned; they must still apply, not fail as unrecognized arguments."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "grpo.yaml"
    assert main(["config", "show", "--config", str(example), "trainer.total_steps=3"]) == 0
    assert "total_steps: 3" in capsys.readouterr().out
