"""How `make test` runs the suite: its recipe run with a stand-in Python that reports what it
was given."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _make_test(tmp_path: Path, **env: str) -> list[str]:
    """`make test` with VENV a virtual environment whose python prints its OMP_NUM_THREADS
    and arguments: the lines the two pytest runs printed."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\necho "OMP_NUM_THREADS=${OMP_NUM_THREADS-unset} $*"\n')
    python.chmod(0o755)
    (venv / ".installed").touch()  # set up: make installs nothing
    os.utime(venv / ".installed", (4e9, 4e9))  # newer than pyproject.toml
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(["make", "-s", "-C", str(REPO), "test", f"VENV={venv}"],
                          env={**base, **env}, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if " -m pytest " in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_the_test_processes_run_one_compute_thread_unless_told_otherwise(tmp_path):
    """torch's default thread per core in each of the processes sharing the cores spins
    their OpenMP threads against each other (the Makefile's comment has the timings)."""
    runs = _make_test(tmp_path)
    assert len(runs) == 2 and all(run.startswith("OMP_NUM_THREADS=1 ") for run in runs)
    (main_run,) = [run for run in runs if " -n " in run]
    assert "--dist loadfile --no-loadscope-reorder" in main_run  # tests/collection_order.py
    runs = _make_test(tmp_path, OMP_NUM_THREADS="4")
    assert all(run.startswith("OMP_NUM_THREADS=4 ") for run in runs)
