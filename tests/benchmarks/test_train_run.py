"""benchmarks/train_run.py: a followed `hybridflow train` run starts in a fresh run directory,
so a reused work directory never shows an earlier run's steps as this run's."""

from __future__ import annotations

import json
import sys

from benchmark_run import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from train_run import run_train  # noqa: E402


def test_an_earlier_runs_metrics_in_the_run_dir_are_not_followed_as_this_runs(tmp_path, capsys):
    run_dir = tmp_path / "run-sync"
    run_dir.mkdir()
    stale = {"step": 1, "timing_s/step": 194.22}
    (run_dir / "metrics.jsonl").write_text(json.dumps(stale) + "\n")
    # a config error: the run exits 2 before its first step
    steps, complete = run_train(
        [f"trainer.run_dir={run_dir}", "trainer.no_such_key=1"], "sync", run_dir, timeout=120
    )
    printed = capsys.readouterr().out
    assert (steps, complete) == ([], False)
    assert "194.22" not in printed and "sync step 1" not in printed
    assert "hybridflow train failed (exit 2)" in printed
    assert not (run_dir / "metrics.jsonl").exists()
