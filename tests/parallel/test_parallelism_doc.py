"""docs/parallelism.md's commands that run a layout on CPU processes work as written, and
each run's first line is the layout the page shows."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hybridflow.cli import main

PAGE = Path(__file__).resolve().parents[2] / "docs" / "parallelism.md"


def blocks_after(heading: str) -> list[str]:
    """The fenced blocks of the page's section ``heading``, in order."""
    section = PAGE.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```")[1::2]


def test_the_page_has_the_cpu_commands_and_the_lines_they_print():
    blocks = blocks_after("Trying a layout on CPU processes")
    assert len(blocks) == 4
    for command, printed in zip(blocks[::2], blocks[1::2]):
        assert command.startswith("sh\nhybridflow train ") and "trainer.device=cpu" in command
        assert printed.strip().startswith("layout on 2 CPU processes (gloo): actor TP=")
    assert "rollout TP=1 EP=2 DP=2" in blocks[3]  # the experts over the rollout's replicas


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1])
def test_the_cpu_layout_commands_of_the_page_run(tmp_path, capsys, index):
    blocks = blocks_after("Trying a layout on CPU processes")
    command, printed = blocks[2 * index], blocks[2 * index + 1]
    words = shlex.split(command.removeprefix("sh\n").replace("\\\n", " "))
    assert words[0] == "hybridflow"
    assert main([*words[1:], f"trainer.run_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == printed.strip()
    assert "done: 2 steps" in out and (tmp_path / "run" / "metrics.jsonl").is_file()
