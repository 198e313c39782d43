"""Checkpoints that survive what users do to them: a damaged latest checkpoint falls back to
the previous one, a full disk leaves no partial save, SIGTERM saves and says how to resume,
a changed config is reported (applied or refused), and a finished run says so."""

from __future__ import annotations

import errno
import os
import shutil
import signal

import pytest
from crafted_checkpoints import (
    declare_bytes_item,
    planted_torch_file,
    point_entry_at,
    reseal,
)
from trainer_helpers import read_metrics, tiny_config

from hybridflow.cli import main
from hybridflow.errors import RunStopped, UserError
from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager
from hybridflow.trainer.lifecycle.checkpoint_files import damage
from hybridflow.trainer.lifecycle.run import train

SAVE_EVERY_STEP = ("trainer.save_freq=1", "trainer.keep_last_k=3", "actor.lr=1e-3")


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A run dir holding complete checkpoints of steps 1 and 2 (copied by each test)."""
    root = tmp_path_factory.mktemp("two_steps")
    train(tiny_config(root, "trainer.total_steps=2", *SAVE_EVERY_STEP), log=lambda *a: None)
    return root


def copy_of(two_steps, tmp_path):
    shutil.copytree(two_steps / "run", tmp_path / "run")
    return tmp_path / "run" / "checkpoints"


def overwrite_shard(step, data: bytes):
    """Same size, other content: only the checksums can tell."""
    with open(step / "actor" / "__0_0.distcp", "r+b") as handle:
        handle.seek(2000)
        handle.write(data)


def link_a_shard(step):
    """The shard moved out of the checkpoint and linked back: same bytes, refused."""
    shard = step / "actor" / "__0_0.distcp"
    outside = step.parent / "outside.distcp"
    shard.rename(outside)
    shard.symlink_to(outside)


@pytest.mark.parametrize(
    "harm",
    [
        pytest.param(lambda step: (step / "actor" / "__0_0.distcp").write_bytes(b"x"), id="truncated"),
        pytest.param(lambda step: (step / "actor" / "extra_rank0.pt").unlink(), id="missing"),
        pytest.param(link_a_shard, id="link"),
        pytest.param(lambda step: overwrite_shard(step, os.urandom(4096)), id="random_bytes"),
        pytest.param(lambda step: overwrite_shard(step, bytes(4096)), id="zeroed_bytes"),
    ],
)  # fmt: skip
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(two_steps, tmp_path, harm):
    checkpoints = copy_of(two_steps, tmp_path)
    harm(checkpoints / "step_2")
    assert damage(checkpoints / "step_2") and not damage(checkpoints / "step_1")
    messages = []
    train(tiny_config(tmp_path, "trainer.total_steps=3", *SAVE_EVERY_STEP), log=messages.append)
    assert any("step_2 is damaged" in m for m in messages), messages
    assert any("resumed from" in m and "step_1" in m for m in messages), messages
    assert sorted(read_metrics(tmp_path / "run")) == [0, 1, 2, 3]
    assert not damage(checkpoints / "step_3")


WEIGHT = "model.lm.model.norm.weight"


def plant_bytes_item(step, marker):
    declare_bytes_item(step / "actor", WEIGHT, planted_torch_file(marker), "__0_9.distcp")


def plant_outside_entry(step, marker):
    (step / "outside.distcp").write_bytes(planted_torch_file(marker))
    point_entry_at(step / "actor", WEIGHT, "../outside.distcp")


def plant_trainer_state(step, marker):
    (step / "trainer_state.pt").write_bytes(planted_torch_file(marker))


@pytest.mark.parametrize(
    "attack, said",
    [
        (plant_bytes_item, "declares the tensor model.lm.model.norm.weight as a pickled bytes"),
        (plant_outside_entry, "names '../outside.distcp', not a file directly inside"),
        (plant_trainer_state, "trainer_state.pt was not loaded"),
    ],
    ids=["bytes_item", "path_outside", "trainer_state"],
)
def test_a_crafted_latest_checkpoint_runs_nothing_and_resume_falls_back(
    two_steps, tmp_path, attack, said
):
    """Crafted by someone who knows the format: metadata.json lists the files as they are."""
    checkpoints = copy_of(two_steps, tmp_path)
    attack(checkpoints / "step_2", tmp_path / "ran")
    reseal(checkpoints / "step_2")
    assert not damage(checkpoints / "step_2")  # only the loader can tell
    messages = []
    train(tiny_config(tmp_path, "trainer.total_steps=3", *SAVE_EVERY_STEP), log=messages.append)
    assert not (tmp_path / "ran").exists()
    refusal = next(m for m in messages if "step_2" in m and "trying the previous one" in m)
    assert said in refusal, refusal
    assert any("resumed from" in m and "step_1" in m for m in messages), messages
    assert sorted(read_metrics(tmp_path / "run")) == [0, 1, 2, 3]


def test_an_explicitly_named_damaged_checkpoint_is_refused(two_steps, tmp_path, capsys):
    checkpoints = copy_of(two_steps, tmp_path)
    (checkpoints / "step_2" / "trainer_state.pt").write_bytes(b"")
    cfg = tiny_config(tmp_path, "trainer.total_steps=3", f"trainer.resume={checkpoints}/step_2")
    with pytest.raises(UserError, match="trainer_state.pt has 0 bytes"):
        train(cfg, log=lambda *a: None)


def test_a_full_disk_removes_the_partial_save_and_says_where(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(1, lambda d: (d / "w.bin").write_bytes(b"1"))

    def disk_full(directory):
        (directory / "half.bin").write_bytes(b"12")
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "half.bin"))

    with pytest.raises(UserError) as info:
        manager.save(2, disk_full)
    assert f"no space left at {tmp_path / 'checkpoints'}" in str(info.value)
    assert "removed" in str(info.value) and "run the same command again" in str(info.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def test_torch_write_failure_on_a_full_disk_is_recognised(tmp_path, monkeypatch):
    """torch.save says only "file write failed" (inline_container.cc): the free space
    decides."""
    import hybridflow.errors as errors

    manager = CheckpointManager(tmp_path / "checkpoints")
    failure = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64; file write failed")  # fmt: skip

    def writer(directory):
        raise failure

    monkeypatch.setattr(errors.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 0))
    with pytest.raises(UserError, match="no space left"):
        manager.save(1, writer)
    monkeypatch.undo()  # with space left the same error is not a full disk: it propagates
    with pytest.raises(RuntimeError, match="file write failed"):
        manager.save(1, writer)
    assert not list((tmp_path / "checkpoints").iterdir())


def test_full_disk_while_training_exits_2_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    import hybridflow.trainer.lifecycle.run_state as run_state

    real_save = run_state.torch.save

    def save_until_step_2(obj, path, *args, **kwargs):
        if "step_2" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(run_state.torch, "save", save_until_step_2)
    cfg = tiny_config(tmp_path, "trainer.total_steps=2", *SAVE_EVERY_STEP)
    argv = [f"{section}.{key}={value}" for section, key, value in overrides_of(cfg)]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "no space left at" in err and "Traceback" not in err
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1"]  # no temp left
    monkeypatch.undo()
    messages = []
    train(cfg, log=messages.append)  # space freed: the same command resumes from step 1
    assert any("resumed from" in m and "step_1" in m for m in messages)
    assert (checkpoints / "step_2" / "COMPLETE").is_file()


FULL_DISK_AT_STEP_2 = """
import errno, sys
import torch.distributed.checkpoint.filesystem as filesystem

real_write_item = filesystem._write_item


def full_disk(transforms, stream, *args, **kwargs):  # every file of step 2, on every thread
    if ".tmp-step_2" in str(getattr(stream, "name", "")):
        raise OSError(errno.ENOSPC, "No space left on device", stream.name)
    return real_write_item(transforms, stream, *args, **kwargs)


filesystem._write_item = full_disk
from hybridflow.cli import main

sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_in_the_checkpoint_writer_threads_prints_one_message(tmp_path):
    """The disk fills while dcp's writer threads write the shards: one message naming the
    directory, exit 2, no traceback of any thread, the last complete checkpoint kept."""
    import subprocess
    import sys

    from trainer_helpers import command_line

    driver = tmp_path / "full_disk.py"
    driver.write_text(FULL_DISK_AT_STEP_2)
    cfg = tiny_config(tmp_path, "trainer.total_steps=2", *SAVE_EVERY_STEP)
    done = subprocess.run([sys.executable, str(driver), "train", *command_line(cfg)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output and "Exception in thread" not in output, output
    checkpoints = tmp_path / "run" / "checkpoints"
    errors = [line for line in output.splitlines() if "rror" in line or "No space" in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: no space left at {checkpoints}")
    assert "free some space" in errors[0]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1"]
    assert (checkpoints / "step_1" / "COMPLETE").is_file()


def overrides_of(cfg):
    """(section, key, value) of the scalar and list settings, for a command line."""
    for section in ("trainer", "data", "rollout", "actor", "reward", "model"):
        for key, value in vars(getattr(cfg, section)).items():
            if isinstance(value, list):
                yield section, key, "[" + ",".join(map(str, value)) + "]"
            elif value is not None and isinstance(value, (int, float, str, bool)):
                yield section, key, value


def test_sigterm_saves_after_the_step_and_says_how_to_resume(tmp_path, monkeypatch):
    import hybridflow.trainer.loop.rl_loop as rl_loop

    real_step = rl_loop.train_step

    def step_then_sigterm(run):
        metrics = real_step(run)
        if run.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler does at the time limit
        return metrics

    monkeypatch.setattr(rl_loop, "train_step", step_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    messages = []
    cfg = tiny_config(tmp_path, "trainer.total_steps=4", "trainer.save_freq=0")
    with pytest.raises(RunStopped) as info:
        train(cfg, log=messages.append)
    assert info.value.exit_code == 143
    assert "stopped by SIGTERM after step 2 of 4" in str(info.value)
    assert "step_2" in str(info.value) and "run the same command again" in str(info.value)
    assert any("SIGTERM: finishing this step" in m for m in messages)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is removed
    monkeypatch.undo()
    messages = []
    train(cfg, log=messages.append)
    assert any("resumed from" in m and "step_2" in m for m in messages)
    assert sorted(read_metrics(tmp_path / "run")) == [0, 1, 2, 3, 4]


def test_a_changed_learning_rate_is_reported_and_applied(two_steps, tmp_path):
    copy_of(two_steps, tmp_path)
    messages = []
    cfg = tiny_config(tmp_path, "trainer.total_steps=3", *SAVE_EVERY_STEP, "actor.lr=5e-4")
    train(cfg, log=messages.append)
    assert any("actor.lr: 0.001 -> 0.0005" in m for m in messages), messages
    metrics = read_metrics(tmp_path / "run")
    assert metrics[2]["actor/lr"] == 1e-3 and metrics[3]["actor/lr"] == 5e-4


def test_a_changed_batch_size_is_refused_with_the_reason(two_steps, tmp_path, capsys):
    copy_of(two_steps, tmp_path)
    cfg = tiny_config(tmp_path, "trainer.total_steps=3", *SAVE_EVERY_STEP,
                      "data.train_batch_size=8", "actor.ppo_mini_batch_size=8")  # fmt: skip
    argv = [f"{section}.{key}={value}" for section, key, value in overrides_of(cfg)]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "data.train_batch_size: 4 -> 8" in err and "learning-rate schedule" in err
    assert "put the old values back" in err and "Traceback" not in err


def checkpoint_of(cfg, step: int = 1) -> None:
    """A complete checkpoint of ``cfg``'s run, holding only its config (what the changed-config
    check reads), from the model path the run will use."""
    import dataclasses

    import yaml

    from hybridflow.trainer.loop.warm_start import planned_model_path

    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=planned_model_path(cfg))
    )
    text = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    CheckpointManager(f"{cfg.trainer.run_dir}/checkpoints").save(
        step, lambda directory: (directory / "config.yaml").write_text(text)
    )


class WarmStartRan(Exception):
    pass


def test_a_changed_config_is_refused_before_the_warm_start(tmp_path, monkeypatch):
    import hybridflow.trainer.loop.warm_start as warm_start

    def warm_start_spy(*args, **kwargs):
        raise WarmStartRan

    monkeypatch.setattr(warm_start, "train_warm_start", warm_start_spy)
    warm = ("model.path=sft:arithmetic", "trainer.total_steps=3")
    checkpoint_of(tiny_config(tmp_path, *warm, "data.train_batch_size=8"))
    with pytest.raises(UserError, match=r"cannot resume .*step_1.*data.train_batch_size: 8 -> 4"):
        train(tiny_config(tmp_path, *warm), log=lambda *a: None)
    # the same config: no refusal (the planned model path is the one the checkpoint names),
    # so the run goes on to its warm start
    shutil.rmtree(tmp_path / "run")
    checkpoint_of(tiny_config(tmp_path, *warm))
    with pytest.raises(WarmStartRan):
        train(tiny_config(tmp_path, *warm), log=lambda *a: None)


def test_a_finished_run_says_so_and_how_to_train_further(two_steps, tmp_path, monkeypatch):
    import hybridflow.trainer.loop.roles as roles

    copy_of(two_steps, tmp_path)
    monkeypatch.setattr(roles, "build_roles", lambda *a: pytest.fail("a model was loaded"))
    messages = []
    assert train(tiny_config(tmp_path, "trainer.total_steps=2"), log=messages.append) == {}
    assert "nothing to do" in messages[0] and "trainer.total_steps=4" in messages[0]
