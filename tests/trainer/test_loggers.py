"""metrics.jsonl contents, resume truncation, console table, backend selection."""

import io
import json
import math

import numpy as np
import pytest
import torch
from rich.console import Console

from hybridflow.trainer.loggers import (
    ConsoleLogger,
    JsonlLogger,
    LoggerUnavailable,
    Tracker,
    clean_metrics,
)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_clean_metrics_converts_scalars_and_drops_the_rest():
    cleaned = clean_metrics(
        {
            "a": torch.tensor(1.5),
            "b": np.float32(2.0),
            "c": math.nan,
            "d": [1, 2],
            "e": torch.ones(3),
            "f": True,
            "g": 3,
        }
    )
    assert cleaned == {"a": 1.5, "b": 2.0, "c": None, "f": 1, "g": 3}


def test_tracker_writes_one_json_object_per_step(tmp_path):
    with Tracker(["jsonl"], tmp_path) as tracker:
        for step in (1, 2, 3):
            tracker.log({"score/mean": torch.tensor(step / 10), "val/arithmetic/mean@1": 0.5}, step)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[1]["score/mean"] == pytest.approx(0.2) and rows[0]["val/arithmetic/mean@1"] == 0.5


def test_resume_drops_lines_written_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = JsonlLogger(path)
    for step in (1, 2, 3):
        logger.log({"x": step}, step)
    logger.close()
    with path.open("a") as handle:
        handle.write('{"step": 4, "x"')  # a line cut by a crash
    resumed = JsonlLogger(path, resume_step=2)
    resumed.log({"x": 30}, 3)
    resumed.close()
    assert read_jsonl(path) == [{"step": 1, "x": 1}, {"step": 2, "x": 2}, {"step": 3, "x": 30}]


def test_console_prints_compact_rows_and_validation(tmp_path):
    buffer = io.StringIO()
    logger = ConsoleLogger(console=Console(file=buffer, width=140, force_terminal=False))
    logger.log({"score/mean": 0.25, "timing_s/step": 1.5, "actor/grad_norm": 0.123456}, 1)
    logger.log(
        {
            "score/mean": 0.5,
            "timing_s/step": 1.25,
            "actor/grad_norm": 0.2,
            "val/arithmetic/mean@1": 0.4,
        },
        2,
    )
    logger.close()
    lines = [line.split() for line in buffer.getvalue().splitlines() if line.strip()]
    assert lines[0] == ["step", "score", "grad", "step_s"]
    assert lines[1] == ["1", "0.25", "0.1235", "1.5"]
    assert lines[2] == ["2", "0.5", "0.2", "1.25"]
    assert "val/arithmetic/mean@1=0.4" in buffer.getvalue()


def test_unknown_and_missing_backends(tmp_path):
    with pytest.raises(ValueError, match="unknown \\['tensorbored'\\]"):
        Tracker(["tensorbored"], tmp_path)
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(LoggerUnavailable, match="pip install tensorboard"):
            Tracker(["jsonl", "tensorboard"], tmp_path)
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(LoggerUnavailable, match="pip install wandb"):
            Tracker(["wandb"], tmp_path)
