"""Run a user benchmark script as a user would, and read the tables it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout: float = 240) -> str:
    """``python benchmarks/<script> args…`` from the repository root; returns its stdout."""
    # the repository first; what the caller's PYTHONPATH adds (an optional peer) kept
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def markdown_rows(text: str, header_start: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))))
    return rows


def number(cell: str) -> float:
    """``"1,234"``, ``"57.2%"`` or ``"0.03"`` as a float."""
    return float(cell.replace(",", "").rstrip("%"))


def load_script(script: str):
    """``benchmarks/<script>`` as a module, for its pure functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the script looks its module up there
    spec.loader.exec_module(module)
    return module
