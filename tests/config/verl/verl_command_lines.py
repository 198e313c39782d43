"""verl example command lines kept as key=value lists (tests/config/verl/command_lines)."""

from __future__ import annotations

from pathlib import Path

COMMAND_LINES = Path(__file__).parent / "command_lines"
RUNS = sorted(p.stem for p in COMMAND_LINES.glob("*.txt")
              if not p.stem.startswith(("stops_", "scale_", "images_")))  # fmt: skip
STOPS = sorted(p.stem for p in COMMAND_LINES.glob("stops_*.txt"))
IMAGES = sorted(p.stem for p in COMMAND_LINES.glob("images_*.txt"))
"""Runs on images: validated with a vision-language model."""
SCALE = sorted(p.stem for p in COMMAND_LINES.glob("scale_*.txt"))
"""Seed-scale layouts: validated against their GPUs, not run."""


def command_line(name: str) -> list[str]:
    lines = (COMMAND_LINES / f"{name}.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]
