"""Checkpoints: atomic publish, keep-last-k, RNG round trip, and a process killed while
writing leaves the previous checkpoint as the one to resume from."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from hybridflow.errors import UserError
from hybridflow.trainer.lifecycle.checkpoint import (
    CheckpointManager,
    is_complete,
    load_rng_state,
    read_metadata,
    save_rng_state,
)


def write_state(step):
    def writer(directory):
        torch.save({"weight": torch.full((3,), float(step))}, directory / "model.pt")
        (directory / "trainer_state.json").write_text(json.dumps({"step": step}))

    return writer


def test_save_publishes_complete_dir_with_metadata(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_k=2)
    assert manager.latest() is None
    path = manager.save(5, write_state(5), metadata={"sampler": {"epoch": 1, "position": 3}})
    assert path == tmp_path / "step_5" and is_complete(path)
    assert read_metadata(path)["step"] == 5
    assert read_metadata(path)["sampler"] == {"epoch": 1, "position": 3}
    assert torch.load(path / "model.pt")["weight"].tolist() == [5.0] * 3
    assert not list(tmp_path.glob(".tmp-*"))


def test_keep_last_k_and_latest_ignores_incomplete(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_k=2)
    for step in (2, 4, 6):
        manager.save(step, write_state(step))
    assert [s for s, _ in manager.complete_checkpoints()] == [4, 6]
    assert not (tmp_path / "step_2").exists()
    # a newer directory without the marker and a temp dir are both ignored
    (tmp_path / "step_8").mkdir()
    (tmp_path / ".tmp-step_10").mkdir()
    assert manager.latest() == tmp_path / "step_6" and manager.latest_step() == 6
    assert manager.resume_candidates("auto") == [tmp_path / "step_6", tmp_path / "step_4"]
    assert manager.resume_candidates("disable") == []
    with pytest.raises(UserError, match="not a complete checkpoint"):
        manager.resume_candidates(str(tmp_path / "step_8"))


def test_resave_same_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_k=3)
    manager.save(4, write_state(4))
    manager.save(4, write_state(40))
    assert torch.load(tmp_path / "step_4" / "model.pt")["weight"][0] == 40.0
    assert [s for s, _ in manager.complete_checkpoints()] == [4]


def test_failed_writer_leaves_previous_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, write_state(1))

    def broken(directory):
        (directory / "model.pt").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        manager.save(2, broken)
    assert manager.latest() == tmp_path / "step_1"


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    save_rng_state(tmp_path)
    expected = (random.random(), np.random.rand(), torch.rand(2).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_rng_state(tmp_path)
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == expected


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager

    root = Path(sys.argv[1])
    manager = CheckpointManager(root, keep_last_k=2)

    def writer(step):
        def write(directory):
            (directory / "state.txt").write_text(str(step))
            if step == 2:
                (directory / "big.bin").write_bytes(b"x" * 1000)
                print("writing", flush=True)
                time.sleep(60)  # killed here, mid-write
        return write

    manager.save(1, writer(1))
    manager.save(2, writer(2))
    """
)


def test_killed_mid_write_resumes_from_last_complete(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    root = tmp_path / "ckpt"
    process = subprocess.Popen(
        [sys.executable, str(script), str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "writing"
        assert (root / ".tmp-step_2" / "big.bin").exists()
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    manager = CheckpointManager(root, keep_last_k=2)
    latest = manager.latest()
    assert latest == root / "step_1" and (latest / "state.txt").read_text() == "1"
    # resuming and saving step 2 again works and cleans the killed attempt
    manager.save(2, lambda d: (d / "state.txt").write_text("2"))
    assert manager.latest() == root / "step_2"
    assert not (root / ".tmp-step_2").exists()
    assert [s for s, _ in manager.complete_checkpoints()] == [1, 2]


def test_os_exit_inside_writer(tmp_path):
    code = (
        "import os; from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager as M;"
        f"m = M({str(tmp_path)!r}); m.save(3, lambda d: (d / 'a').write_text('a'));"
        "m.save(4, lambda d: os._exit(1))"
    )
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 1 and time.monotonic() - start < 60
    assert CheckpointManager(tmp_path).latest() == tmp_path / "step_3"
