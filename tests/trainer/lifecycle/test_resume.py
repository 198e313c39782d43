"""Resuming is exact: 4 steps straight == 2 steps, stop, resume to 4; and a process killed
while writing a checkpoint resumes from the last complete one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from trainer_helpers import CLOCKED, REPO, command_line, read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import train

# Wall-clock and memory readings differ between runs; everything else must be identical.
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", *CLOCKED)


def training_metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE) and not k.startswith("val/")}


def assert_same_steps(straight: dict, resumed: dict, steps) -> None:
    for step in steps:
        a, b = training_metrics(straight[step]), training_metrics(resumed[step])
        assert a.keys() == b.keys(), step
        differing = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not differing, f"step {step}: {differing}"


# KL controller state, sampler position, optimizer and RNG all matter here: adaptive KL in
# the reward, shuffled data, and sampling seeds.
RESUME_SETTINGS = (
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl_type=adaptive",
    "algorithm.kl_coef=0.05",
    "actor.lr=1e-3",
    "actor.ppo_mini_batch_size=2",
)


def test_resume_is_exact(tmp_path, quiet):
    straight = tiny_config(tmp_path / "a", "trainer.total_steps=4", *RESUME_SETTINGS)
    train(straight, log=quiet)
    first = tiny_config(tmp_path / "b", "trainer.total_steps=2", *RESUME_SETTINGS)
    train(first, log=quiet)
    second = tiny_config(
        tmp_path / "b", "trainer.total_steps=4", "trainer.resume=auto", *RESUME_SETTINGS
    )
    train(second, log=quiet)
    a, b = read_metrics(straight.trainer.run_dir), read_metrics(second.trainer.run_dir)
    assert sorted(b) == [0, 1, 2, 3, 4]  # metrics.jsonl continued, not restarted
    assert a[4]["actor/reward_kl_penalty_coeff"] != a[1]["actor/reward_kl_penalty_coeff"]
    assert_same_steps(a, b, steps=(1, 2, 3, 4))
    assert a[4]["val/arithmetic/mean@1"] == b[4]["val/arithmetic/mean@1"]


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import hybridflow.trainer.lifecycle.run_state as state
    from hybridflow.config import load_config
    from hybridflow.trainer.lifecycle.run import train

    original = state.write_model_files

    def write_then_die(directory, cfg, tokenizer, dtype):
        # Step 2's weights are on disk but the checkpoint is not complete yet.
        if directory.name == ".tmp-step_2":
            os.kill(os.getpid(), signal.SIGKILL)
        original(directory, cfg, tokenizer, dtype)

    state.write_model_files = write_then_die
    train(load_config(None, sys.argv[1:]), log=lambda *a, **k: None)
    """
)


def test_killed_while_saving_resumes_from_last_complete(tmp_path, quiet):
    cfg = tiny_config(tmp_path / "k", "trainer.total_steps=3", "trainer.save_freq=1",
                      "trainer.async_save=false")  # fmt: skip
    overrides = command_line(cfg)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, *overrides], env=env, capture_output=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    checkpoints = tmp_path / "k" / "run" / "checkpoints"
    assert (checkpoints / "step_1" / "COMPLETE").is_file()
    assert (checkpoints / ".tmp-step_2").is_dir() and not (checkpoints / "step_2").exists()

    messages = []
    train(cfg, log=messages.append)  # trainer.resume=auto by default
    assert any("resumed from" in m and "step_1" in m for m in messages), messages
    assert not (checkpoints / ".tmp-step_2").exists()  # the half-written save was cleaned up
    assert (checkpoints / "step_3" / "COMPLETE").is_file()

    straight = tiny_config(tmp_path / "s", "trainer.total_steps=3", "trainer.save_freq=1")
    train(straight, log=quiet)
    assert_same_steps(
        read_metrics(straight.trainer.run_dir), read_metrics(cfg.trainer.run_dir), (2, 3)
    )


def test_checkpoints_record_the_engine_choices_and_resume_pins_them(tmp_path, quiet, monkeypatch):
    """Each checkpoint holds the rollout engine's timing choices (engine_choices.json); a
    resumed run hands them back to the engine before it generates, so it runs the same
    kernels (on CPU the torch backend has none: the identity and the empty set travel)."""
    import json

    from hybridflow.engine.engine import Engine

    first = tiny_config(tmp_path / "c", "trainer.total_steps=1", *RESUME_SETTINGS)
    train(first, log=quiet)
    saved = tmp_path / "c" / "run" / "checkpoints" / "step_1" / "engine_choices.json"
    recorded = json.loads(saved.read_text())
    assert set(recorded) == {"identity", "choices"}
    pinned = []
    real = Engine.pin_choices
    monkeypatch.setattr(Engine, "pin_choices",
                        lambda self, choices: pinned.append(choices) or real(self, choices))  # fmt: skip
    again = tiny_config(tmp_path / "c", "trainer.total_steps=2", "trainer.resume=auto",
                        *RESUME_SETTINGS)  # fmt: skip
    train(again, log=quiet)
    assert pinned == [recorded]


def test_resume_at_an_epoch_boundary_is_exact(tmp_path, quiet):
    """12 prompts, 4 a step: step 3 ends epoch 0, so the resumed run starts epoch 1 (a new
    permutation) from the sampler's saved position."""
    epoch = ("data.builtin_train_size=12", *RESUME_SETTINGS)
    train(tiny_config(tmp_path / "a", "trainer.total_steps=5", *epoch), log=quiet)
    train(tiny_config(tmp_path / "b", "trainer.total_steps=3", *epoch), log=quiet)
    train(tiny_config(tmp_path / "b", "trainer.total_steps=5", *epoch), log=quiet)
    a, b = read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "b" / "run")
    assert_same_steps(a, b, steps=(1, 2, 3, 4, 5))


def test_resume_with_optimizer_offload_is_exact(tmp_path, quiet):
    """The host masters and AdamW state go into the checkpoint and come back: 4 steps
    straight == 2 + resume 2 with actor.optimizer_offload (the host step on the CPU)."""
    settings = (*RESUME_SETTINGS, "actor.optimizer_offload=true")
    straight = tiny_config(tmp_path / "a", "trainer.total_steps=4", *settings)
    train(straight, log=quiet)
    train(tiny_config(tmp_path / "b", "trainer.total_steps=2", *settings), log=quiet)
    second = tiny_config(tmp_path / "b", "trainer.total_steps=4", "trainer.resume=auto", *settings)
    train(second, log=quiet)
    a, b = read_metrics(straight.trainer.run_dir), read_metrics(second.trainer.run_dir)
    assert_same_steps(a, b, steps=(1, 2, 3, 4))
    assert a[4]["actor/pg_loss"] != a[1]["actor/pg_loss"]  # it trained
