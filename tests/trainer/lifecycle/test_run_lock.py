"""trainer/lifecycle/run_lock.py: a second ``hybridflow train`` on a run directory in use is refused
(exit 2, naming the holder) and writes nothing; a lock left by a killed process is taken over,
with a message that says so."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.trainer.lifecycle.run_lock import LOCK_FILE, RunDirBusy, hold_run_dir

REPO = Path(__file__).resolve().parents[3]
HOLD = """
import sys, time
from hybridflow.trainer.lifecycle.run_lock import hold_run_dir
with hold_run_dir(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def start_holder(run_dir: Path) -> subprocess.Popen:
    """Another process that holds ``run_dir`` until killed; returns once it holds it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_train_on_a_held_run_dir_exits_2_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        command = [sys.executable, "-c", "import sys; from hybridflow.cli import main; "
                   "sys.exit(main())", "train", f"trainer.run_dir={run_dir}",
                   f"trainer.cache_dir={tmp_path / 'cache'}", "trainer.device=cpu"]  # fmt: skip
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"trainer.run_dir = {run_dir} is in use by another process" in second.stderr
        assert f"pid {holder.pid} on host" in second.stderr and "Traceback" not in second.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing written
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_process_is_taken_over_and_said(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    os.kill(holder.pid, signal.SIGKILL)  # no cleanup runs: its text stays in the file
    holder.wait()
    messages = []
    with hold_run_dir(run_dir, log=messages.append):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(messages) == 1 and f"taking over the lock left by pid {holder.pid}" in messages[0]
    assert "no longer running" in messages[0]
    assert (run_dir / LOCK_FILE).read_text() == ""  # a normal end leaves no holder behind
    with hold_run_dir(run_dir, log=messages.append):
        pass
    assert len(messages) == 1  # nothing to take over after a normal end


def test_a_held_directory_is_refused_in_this_process_too(tmp_path):
    with hold_run_dir(tmp_path, log=print), pytest.raises(RunDirBusy) as refused:
        with hold_run_dir(tmp_path, key="sft.out_dir"):
            pass
    assert f"pid {os.getpid()}" in str(refused.value) and "sft.out_dir" in str(refused.value)
    started = time.strftime("%Y-%m-%d")
    assert started in str(refused.value)


def test_a_run_refused_before_it_writes_leaves_no_directory_it_made(tmp_path):
    run_dir = tmp_path / "runs" / "grpo"
    with pytest.raises(ValueError), hold_run_dir(run_dir):
        raise ValueError("refused by a later check")
    assert not (tmp_path / "runs").exists()  # both levels it created are gone


def test_a_directory_that_existed_or_holds_files_is_kept(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    with hold_run_dir(existing):
        pass
    assert existing.is_dir()
    written = tmp_path / "written"
    with hold_run_dir(written):
        (written / "metrics.jsonl").write_text("{}")
    assert (written / "metrics.jsonl").exists()


PUBLISH_LATER = """
import sys, time
from pathlib import Path
from hybridflow.trainer.lifecycle.run_lock import wait_for_turn
target = Path(sys.argv[1])
with wait_for_turn(target.with_name(target.name + ".lock"), "trains this warm start"):
    print("training", flush=True)
    time.sleep(2)
    target.mkdir(parents=True)
    (target / "COMPLETE").write_text("{}")
"""


def test_a_second_run_of_the_same_warm_start_waits_and_uses_the_first_ones_model(
    tmp_path, monkeypatch
):
    import hybridflow.trainer.loop.warm_start as warm_start
    from hybridflow.config import load_config

    cfg = load_config(None, ["model.path=sft:arithmetic", f"trainer.cache_dir={tmp_path}"])
    target = warm_start.planned_model_path(cfg)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-c", PUBLISH_LATER, target], env=env,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert first.stdout.readline().strip() == "training"
    monkeypatch.setattr(warm_start, "train_warm_start", lambda *a: pytest.fail("trained twice"))
    messages = []
    assert warm_start.resolve_model_path(cfg, log=messages.append) == target
    assert first.wait(timeout=60) == 0
    assert f"waiting for pid {first.pid} on host" in messages[0]
    assert "which trains this warm start" in messages[0]
    assert "trained by the process waited for" in messages[1]
