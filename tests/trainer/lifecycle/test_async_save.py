"""Checkpoints written in the background (trainer.async_save): the same files as a blocking
save, training goes on while they are written, a failed write is raised with the previous
checkpoint kept, and a process killed mid-write resumes from the last complete one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from test_resume import RESUME_SETTINGS, assert_same_steps
from trainer_helpers import REPO, command_line, read_metrics, tiny_config

import hybridflow.learners.state_writer as state_writer
from hybridflow.trainer.lifecycle.pending_save import CheckpointWriteError
from hybridflow.trainer.lifecycle.run import train

SAVE_EVERY_STEP = ("trainer.save_freq=1", "trainer.test_freq=0", *RESUME_SETTINGS)


def checkpoint_tensors(step_dir: Path, tmp_path: Path) -> dict:
    """The actor's DCP files (model + optimizer) and trainer_state.pt, loaded."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_dir.parent.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir / "actor", out)
    return {
        "actor": torch.load(out, weights_only=True),
        "extra": torch.load(step_dir / "actor" / "extra_rank0.pt", weights_only=True),
        "trainer": torch.load(step_dir / "trainer_state.pt", weights_only=True),
    }


def assert_identical(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{index}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def test_async_save_writes_what_a_blocking_save_writes_and_resumes_exactly(tmp_path, quiet):
    blocking = tiny_config(tmp_path / "sync", "trainer.total_steps=4", "trainer.async_save=false",
                           *SAVE_EVERY_STEP)  # fmt: skip
    background = tiny_config(tmp_path / "async", "trainer.total_steps=4", *SAVE_EVERY_STEP)
    assert background.trainer.async_save is None  # the default: on for a model this small
    train(blocking, log=quiet)
    train(background, log=quiet)
    train(tiny_config(tmp_path / "resumed", "trainer.total_steps=2", *SAVE_EVERY_STEP), log=quiet)
    resumed = tiny_config(tmp_path / "resumed", "trainer.total_steps=4", *SAVE_EVERY_STEP)
    messages = []
    train(resumed, log=messages.append)
    assert any("resumed from" in m and "step_2" in m for m in messages), messages

    runs = [Path(cfg.trainer.run_dir) for cfg in (blocking, background, resumed)]
    metrics = [read_metrics(run) for run in runs]
    assert_same_steps(metrics[0], metrics[1], (1, 2, 3, 4))
    assert_same_steps(metrics[0], metrics[2], (1, 2, 3, 4))
    for step in (3, 4):  # keep_last_k=2
        saved = [checkpoint_tensors(run / "checkpoints" / f"step_{step}", tmp_path) for run in runs]
        assert saved[0]["actor"]["optimizer"]["state"]  # AdamW moments are in there
        assert_identical(saved[0], saved[1], f"step_{step}")
        for run in (saved[0], saved[2]):  # the resumed run also validated at its stop, step 2
            run["trainer"].pop("history")
        assert_identical(saved[0], saved[2], f"step_{step}")
    assert len(list((runs[1] / "checkpoints" / "step_4" / "actor").glob("*.distcp"))) == (
        state_writer.WRITE_THREADS
    )


def test_the_next_step_trains_while_the_checkpoint_is_still_being_written(
    tmp_path, quiet, monkeypatch
):
    """Step 1's write is held until step 2 is running: a blocking save would never let
    step 2 start (and the held write gives up after 20 s, failing the run)."""
    import hybridflow.trainer.loop.rl_loop as rl_loop

    release, written = threading.Event(), threading.Event()
    seen_at_step_2 = {}
    real_write, real_step = state_writer._write_files, rl_loop.train_step

    def held_write(state, directory, *args):
        if directory.parent.name == ".tmp-step_1":
            if not release.wait(timeout=20):
                raise TimeoutError("step 1's write was never released")
        real_write(state, directory, *args)
        if directory.parent.name == ".tmp-step_1":
            written.set()

    def step(run, *args, **kwargs):
        if run.step == 2:
            seen_at_step_2["written"] = written.is_set()
            seen_at_step_2["latest"] = run.checkpoints.latest()
            release.set()
        return real_step(run, *args, **kwargs)

    monkeypatch.setattr(state_writer, "_write_files", held_write)
    monkeypatch.setattr(rl_loop, "train_step", step)
    cfg = tiny_config(tmp_path, "trainer.total_steps=2", "trainer.save_freq=1")
    train(cfg, log=quiet)
    assert seen_at_step_2 == {"written": False, "latest": None}  # step 1 not complete yet
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2"]
    assert all((checkpoints / name / "COMPLETE").is_file() for name in ("step_1", "step_2"))


def test_a_failed_background_write_stops_the_run_and_keeps_the_previous_checkpoint(
    tmp_path, quiet, monkeypatch
):
    real_write = state_writer._write_files

    def failing_write(state, directory, *args):
        if directory.parent.name == ".tmp-step_2":
            raise OSError(5, "Input/output error", str(directory / "__0_0.distcp"))
        real_write(state, directory, *args)

    monkeypatch.setattr(state_writer, "_write_files", failing_write)
    cfg = tiny_config(tmp_path, "trainer.total_steps=4", "trainer.save_freq=1")
    with pytest.raises(CheckpointWriteError) as info:
        train(cfg, log=quiet)
    checkpoints = tmp_path / "run" / "checkpoints"
    message = str(info.value)
    assert "step 2" in message and "Input/output error" in message
    assert str(checkpoints / ".tmp-step_2") in message
    assert f"{checkpoints / 'step_1'} is still the latest complete one" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1"]  # no half checkpoint
    assert (checkpoints / "step_1" / "COMPLETE").is_file()
    assert max(read_metrics(tmp_path / "run")) < 4  # stopped, not trained to the end


KILLED_WHILE_WRITING = textwrap.dedent(
    """
    import os, signal, sys
    import hybridflow.learners.state_writer as state_writer
    from hybridflow.config import load_config
    from hybridflow.trainer.lifecycle.run import train

    real_write = state_writer._write_files

    def write_half_then_die(state, directory, *args):
        # On the writer thread, while the main thread trains step 3: step 2's model and
        # optimizer files are on disk, its extra file and the trainer's files are not.
        if directory.parent.name == ".tmp-step_2":
            import torch.distributed.checkpoint as dcp
            dcp.save(state, checkpoint_id=str(directory), no_dist=True)
            os.kill(os.getpid(), signal.SIGKILL)
        real_write(state, directory, *args)

    state_writer._write_files = write_half_then_die
    train(load_config(None, sys.argv[1:]), log=lambda *a, **k: None)
    """
)


def test_killed_during_a_background_write_resumes_from_the_last_complete(tmp_path, quiet):
    cfg = tiny_config(tmp_path / "k", "trainer.total_steps=3", "trainer.save_freq=1")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING, *command_line(cfg)],
                            env=env, capture_output=True, timeout=300)  # fmt: skip
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    checkpoints = tmp_path / "k" / "run" / "checkpoints"
    assert (checkpoints / "step_1" / "COMPLETE").is_file()
    assert (checkpoints / ".tmp-step_2" / "actor" / ".metadata").is_file()
    assert not (checkpoints / "step_2").exists()

    messages = []
    train(cfg, log=messages.append)
    assert any("resumed from" in m and "step_1" in m for m in messages), messages
    assert not (checkpoints / ".tmp-step_2").exists()
    assert (checkpoints / "step_3" / "COMPLETE").is_file()
    straight = tiny_config(tmp_path / "s", "trainer.total_steps=3", "trainer.save_freq=1")
    train(straight, log=quiet)
    assert_same_steps(read_metrics(tmp_path / "s" / "run"), read_metrics(tmp_path / "k" / "run"),
                      (2, 3))  # fmt: skip


def test_sigterm_during_a_background_write_waits_for_it_before_stopping(
    tmp_path, quiet, monkeypatch
):
    """SIGTERM in step 2, whose checkpoint is still being written when the loop stops: the
    stop waits for it (without the wait it would find step 1 the latest and save step 2
    again over the directory being written)."""
    import signal

    import hybridflow.trainer.loop.rl_loop as rl_loop
    from hybridflow.errors import RunStopped

    real_write, real_step = state_writer._write_files, rl_loop.train_step

    def slow_write(state, directory, *args):
        if directory.parent.name == ".tmp-step_2":
            threading.Event().wait(1.0)  # still writing when the loop reaches the stop
        real_write(state, directory, *args)

    def step_then_sigterm(run, *args, **kwargs):
        metrics = real_step(run, *args, **kwargs)
        if run.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    monkeypatch.setattr(state_writer, "_write_files", slow_write)
    monkeypatch.setattr(rl_loop, "train_step", step_then_sigterm)
    cfg = tiny_config(tmp_path, "trainer.total_steps=4", "trainer.save_freq=1")
    with pytest.raises(RunStopped) as info:
        train(cfg, log=quiet)
    assert "stopped by SIGTERM after step 2 of 4" in str(info.value)
    assert "the checkpoint of step 2 is complete" in str(info.value)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2"]
