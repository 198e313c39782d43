"""SIGTERM / SIGINT during each long phase of a real ``hybridflow`` process: it stops within
seconds (each phase here would run for many minutes), says what it saved, and nothing the
user had is lost. The phases: the SFT warm start (its progress is saved and a later run
continues it to the very model an uninterrupted SFT makes), a validation after a step (the
step's checkpoint is saved), the RL step (finished, then saved), the validation before the
first step (nothing to save: stops at once), ``hybridflow sft`` (a checkpoint, resumable) and
``hybridflow export`` (the partial output is removed)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from trainer_helpers import REPO, TINY

from hybridflow.errors import RunStopped
from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager

STOPS_WITHIN_S = 60
"""A generous bound for a loaded CI host; every phase below would run for many minutes."""

MAIN = "import sys; from hybridflow.cli import main; sys.exit(main())"


class Running:
    """A ``hybridflow`` subprocess whose output lines are read as they come."""

    def __init__(self, args: list[str], script: str = MAIN):
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen([sys.executable, "-c", script, *args], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)  # fmt: skip
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, text: str, timeout_s: float = 240) -> None:
        """Until a line holds ``text`` (the phase has started)."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            try:
                line = self._queue.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            assert line is not None, f"no {text!r} in the output:\n" + "\n".join(self.lines)
            self.lines.append(line)

    def stop(self, signum: int = signal.SIGTERM) -> tuple[int, str]:
        """Send ``signum``; (exit status, whole output) once it ends (within STOPS_WITHIN_S)."""
        self.process.send_signal(signum)
        try:
            status = self.process.wait(timeout=STOPS_WITHIN_S)
        finally:
            self.process.kill()
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return status, "\n".join(self.lines)


def train_args(tmp_path: Path, *overrides: str) -> list[str]:
    return ["train", *TINY, f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={tmp_path / 'cache'}", *overrides]  # fmt: skip


LONG_WARM_START = ("model.path=sft:arithmetic", "sft.preset=tiny", "sft.total_steps=100000",
                   "sft.stop_at_accuracy=null", "sft.builtin_size=256", "sft.batch_size=8")  # fmt: skip


@pytest.mark.slow
def test_sigterm_in_the_warm_start_saves_its_progress(tmp_path):
    run = Running(train_args(tmp_path, *LONG_WARM_START))
    run.wait_for("sft step 50/100000")
    status, output = run.stop()
    assert status == 143 and "Traceback" not in output, output
    assert "SIGTERM: saving the warm start's progress after this SFT step" in output
    assert "stopped by SIGTERM during the warm start SFT at step" in output
    assert "the same command continues it from there" in output
    [progress] = (tmp_path / "cache").glob("sft-arithmetic-*.progress")
    assert CheckpointManager(progress).latest_step() >= 50  # not the whole SFT lost
    assert not list((tmp_path / "cache").glob("sft-arithmetic-*[0-9a-f]"))  # not published
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_stopped_warm_start_continues_to_the_model_an_uninterrupted_one_makes(tmp_path,
                                                                                monkeypatch):  # fmt: skip
    import hybridflow.trainer.loop.sft_loop as sft_loop
    from hybridflow.config import load_config
    from hybridflow.trainer.lifecycle.stop import StopRequest
    from hybridflow.trainer.loop.warm_start import resolve_model_path

    settings = ["trainer.device=cpu", "model.path=sft:arithmetic", "sft.preset=tiny",
                "sft.total_steps=6", "sft.stop_at_accuracy=1.0", "sft.eval_every=3",
                "sft.eval_size=4", "sft.builtin_size=64", "sft.batch_size=8"]  # fmt: skip
    quiet = lambda *a: None  # noqa: E731
    straight = resolve_model_path(load_config(None, [*settings, f"trainer.cache_dir={tmp_path / 'a'}"]), log=quiet)  # fmt: skip

    cfg = load_config(None, [*settings, f"trainer.cache_dir={tmp_path / 'b'}"])
    real_step = sft_loop.SFTTrainer.step

    def step_then_sigterm(trainer, batch):
        metrics = real_step(trainer, batch)
        if trainer.steps_done == 3:  # step 4 is running: a scheduler's SIGTERM arrives
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    monkeypatch.setattr(sft_loop.SFTTrainer, "step", step_then_sigterm)
    stop = StopRequest()
    with stop.on_signals(quiet), pytest.raises(RunStopped, match="at step 4 of at most 6"):
        resolve_model_path(cfg, log=quiet, stop=stop)
    monkeypatch.undo()
    lines = []
    continued = resolve_model_path(cfg, log=lines.append)
    assert any("continuing the SFT from step 4" in line for line in lines), lines
    assert not Path(continued + ".progress").exists()  # removed once the model is published
    from safetensors.torch import load_file

    a, b = load_file(f"{straight}/model.safetensors"), load_file(f"{continued}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigterm_in_a_validation_after_a_step_saves_that_step(tmp_path):
    run = Running(train_args(tmp_path, "trainer.total_steps=3", "trainer.test_freq=1",
                             "trainer.val_before_train=false", "data.builtin_val_size=2000",
                             "data.val_batch_size=1", "trainer.save_freq=0"))  # fmt: skip
    run.wait_for("validation at step 1:")
    status, output = run.stop()
    assert status == 143 and "Traceback" not in output, output
    assert "SIGTERM: ending the validation, then saving the checkpoint of step 1" in output
    assert "validation at step 1 ended early: not reported" in output
    assert "stopped by SIGTERM after step 1 of 3: saved" in output
    assert CheckpointManager(tmp_path / "run" / "checkpoints").latest_step() == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if line]  # fmt: skip
    assert [row["step"] for row in rows] == [1] and not any(k.startswith("val/") for k in rows[0])


@pytest.mark.slow
def test_ctrl_c_in_the_rl_loop_finishes_the_step_and_saves_it(tmp_path):
    run = Running(train_args(tmp_path, "trainer.total_steps=100000", "trainer.test_freq=0",
                             "trainer.val_before_train=false", "trainer.loggers=[jsonl,console]"))  # fmt: skip
    run.wait_for("step")  # the console's first table row: step 1 is done, step 2 running
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not metrics.exists() or not metrics.read_text():
        time.sleep(0.1)
    status, output = run.stop(signal.SIGINT)
    assert status == 130 and "Traceback" not in output, output
    assert "SIGINT: finishing this step, then saving a checkpoint and stopping" in output
    step = CheckpointManager(tmp_path / "run" / "checkpoints").latest_step()
    assert step >= 1 and f"stopped by SIGINT after step {step} of 100000: saved" in output
    rows = [json.loads(line) for line in metrics.read_text().split("\n") if line]
    assert [row["step"] for row in rows] == list(range(1, step + 1))


@pytest.mark.slow
def test_sigterm_in_the_validation_before_training_stops_at_once(tmp_path):
    run = Running(train_args(tmp_path, "data.builtin_val_size=2000", "data.val_batch_size=1"))
    run.wait_for("validation at step 0:")
    status, output = run.stop()
    assert status == 143 and "Traceback" not in output, output
    assert "SIGTERM: stopping now (nothing to save at this point)" in output
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_sigterm_in_sft_saves_a_checkpoint_it_resumes_from(tmp_path):
    args = ["sft", "model.path=sft:arithmetic", "sft.preset=tiny", "sft.total_steps=100000",
            "sft.builtin_size=256", "sft.batch_size=8", "trainer.device=cpu",
            "trainer.loggers=[jsonl]", f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    run = Running(args)
    run.wait_for("SFT: ")
    metrics = tmp_path / "run" / "sft" / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().split("\n")) < 20:
        time.sleep(0.1)
    status, output = run.stop()
    assert status == 143 and "Traceback" not in output, output
    step = CheckpointManager(tmp_path / "run" / "sft" / "checkpoints").latest_step()
    assert step >= 19 and f"stopped by SIGTERM after SFT step {step} of 100000: saved" in output
    assert "run the same command again to resume" in output


SLOW_EXPORT = """
import sys, time
import hybridflow.learners.actor_learner as actor_learner
from hybridflow.cli import main

write = actor_learner.export_causal_lm

def write_then_wait(*args, **kwargs):  # a big model: the weights take minutes to write
    write(*args, **kwargs)
    print("weights written", flush=True)
    time.sleep(600)

actor_learner.export_causal_lm = write_then_wait
sys.exit(main())
"""


@pytest.mark.slow
def test_sigterm_in_export_removes_the_partial_model(tmp_path):
    from trainer_helpers import tiny_config

    from hybridflow.trainer.lifecycle.run import train

    train(tiny_config(tmp_path, "trainer.total_steps=1", "trainer.val_before_train=false"),
          log=lambda *a: None)  # fmt: skip
    out = tmp_path / "exported"
    run = Running(["export", str(tmp_path / "run" / "checkpoints" / "step_1"), str(out)],
                  script=SLOW_EXPORT)  # fmt: skip
    run.wait_for("weights written")
    status, output = run.stop()
    assert status == 143 and "Traceback" not in output, output
    assert f"removed the partial export {out}" in output and not out.exists()
