"""``--help`` of every command: each option says what it does and its default, and each
subcommand has its own description."""

from __future__ import annotations

import argparse

import pytest

from hybridflow.cli import build_parser, main, walk_parsers

PARSERS = dict(walk_parsers(build_parser()))


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    skip = (argparse._HelpAction, argparse._SubParsersAction)
    return [a for a in parser._actions if not isinstance(a, skip)]


def _rendered_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text as ``--help`` prints it, the default appended by the formatter."""
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


@pytest.mark.parametrize("path", list(PARSERS), ids=" ".join)
def test_every_option_says_what_it_does(path):
    parser = PARSERS[path]
    if not parser.add_help:  # the stand-in of a subcommand unavailable here
        return
    # "default: cuda if available" alone says the default, not what the option does
    missing = [
        a.dest
        for a in _options(parser)
        if not (a.help or "").strip() or a.help.lower().startswith("default")
    ]
    assert not missing, f"{' '.join(path)}: options without help: {missing}"


@pytest.mark.parametrize("path", list(PARSERS), ids=" ".join)
def test_every_option_that_takes_a_value_says_its_default(path):
    parser = PARSERS[path]
    takes_value = [
        a
        for a in _options(parser)
        if a.nargs != 0 and not a.required and (a.option_strings or a.nargs in ("?", "*"))
    ]
    silent = [a.dest for a in takes_value if "default" not in _rendered_help(parser, a).lower()]
    assert not silent, f"{' '.join(path)}: options that do not say their default: {silent}"


def test_every_subcommand_has_its_own_description():
    commands = {path: p for path, p in PARSERS.items() if len(path) > 1 and p.add_help}
    described = {path: p.description for path, p in commands.items()}
    assert all(described.values()), [" ".join(p) for p, d in described.items() if not d]
    assert len(set(described.values())) == len(described)


def test_config_actions_print_different_help(capsys):
    texts = []
    for action in ("show", "validate", "plan", "from-verl"):
        with pytest.raises(SystemExit):
            main(["config", action, "--help"])
        texts.append(capsys.readouterr().out)
    assert len(set(texts)) == 4
    assert "--gpu-memory" in texts[2] and "--gpu-memory" not in texts[0]


@pytest.mark.parametrize("command", [["train"], ["sft"], ["config", "show"]])
def test_help_says_where_the_keys_are_documented(capsys, command):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "hybridflow/config/sections.py" in out and "hybridflow config show" in out


def test_defaults_are_shown(capsys):
    with pytest.raises(SystemExit):
        main(["data", "arithmetic", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 4000)" in out


def test_sft_help_shows_sft_examples_not_rl_ones(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "sft.train_files=" in out and "sft.lr=" in out
    assert "rollout." not in out and "actor." not in out and "grpo" not in out
    assert "data.train_files" not in out  # SFT reads sft.train_files
