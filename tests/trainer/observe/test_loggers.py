"""metrics.jsonl contents, resume truncation, console table, backend selection."""

import io
import json
import math
import re
import warnings

import numpy as np
import pytest
import torch
from progress_helpers import FakeClock, log_reporter
from rich.console import Console

from hybridflow.install_hint import extra_install
from hybridflow.trainer.observe.loggers import (
    CELL_WIDTH,
    STEP_WIDTH,
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
        with pytest.raises(LoggerUnavailable, match=re.escape(extra_install("tensorboard"))):
            Tracker(["jsonl", "tensorboard"], tmp_path)
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(LoggerUnavailable, match=re.escape(extra_install("wandb"))):
            Tracker(["wandb"], tmp_path)


def test_table_lines_have_one_width_whatever_the_values_and_terminal():
    buffer = io.StringIO()
    logger = ConsoleLogger(console=Console(file=buffer, width=40, force_terminal=False))
    first = {"score/mean": 0.5, "actor/pg_loss": -2.484e-09, "actor/grad_norm": 12345678.9}
    logger.log({**first, "timing_s/step": 1.5, "perf/tokens_per_s_per_gpu": 123456789012}, 1)
    logger.log({"score/mean": None, "actor/pg_loss": 1e300, "timing_s/step": 0.001}, 2)
    logger.close()
    lines = buffer.getvalue().splitlines()
    width = STEP_WIDTH + 5 * (CELL_WIDTH + 1)  # step, then score, pg_loss, grad, tok/s, step_s
    assert len(lines) == 3  # header and two rows: nothing wrapped at the 40 columns
    assert [len(line) for line in lines] == [width] * 3
    assert lines[2].split() == ["2", "-", "1e+300", "-", "-", "0.001"]


def test_warnings_print_once_above_a_fresh_header_never_between_rows():
    reporter, buffer = log_reporter(FakeClock())
    logger = ConsoleLogger(progress=reporter)
    with reporter.collecting_warnings():
        logger.log({"score/mean": 0.1}, 1)
        for _ in range(3):
            warnings.warn("a library says so", UserWarning, stacklevel=1)
        logger.log({"score/mean": 0.2}, 2)
        logger.log({"score/mean": 0.3}, 3)
    lines = [line.strip() for line in buffer.getvalue().splitlines()]
    assert len(lines) == 6, lines
    assert lines[0].split() == ["step", "score"] and lines[1].split() == ["1", "0.1"]
    assert lines[2].startswith("warning: UserWarning: a library says so (observe/test_loggers.py:")
    assert lines[3].split() == ["step", "score"]
    assert [line.split()[0] for line in lines[4:]] == ["2", "3"]


def test_a_one_process_checkpoint_prints_no_warning_and_the_filters_come_back(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    reporter, buffer = log_reporter(FakeClock())
    filters_before, handler_before = list(warnings.filters), warnings.showwarning
    with reporter.collecting_warnings():
        state = {"w": torch.ones(2)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
        warnings.warn("a library says so", UserWarning, stacklevel=1)
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 1 and "a library says so" in lines[0], lines
    assert warnings.filters == filters_before and warnings.showwarning is handler_before


def _header(device: str, metrics: dict) -> list[str]:
    buffer = io.StringIO()
    logger = ConsoleLogger(console=Console(file=buffer, width=200), device=device)
    logger.log(metrics, 1)
    return buffer.getvalue().splitlines()[0].split()


def test_the_two_kls_are_named_apart():
    # the update's drift from the sampling policy is not the KL to the reference a verl
    # user reads as "kl": each gets its own name
    metrics = {"actor/ppo_kl": 0.01, "actor/kl_loss": 0.2, "actor/reward_kl_penalty": 0.3}
    assert _header("cuda", metrics) == ["step", "ppo_kl", "ref_kl", "ref_kl_pen"]


def test_throughput_is_per_gpu_on_a_gpu_and_per_process_on_a_cpu():
    metrics = {"perf/tokens_per_s_per_gpu": 900.0}
    assert _header("cuda", metrics) == ["step", "tok/s/gpu"]
    assert _header("cpu", metrics) == ["step", "tok/s/proc"]
