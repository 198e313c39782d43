"""The lines a finished run prints: validation before and after, or once without a gain."""

from __future__ import annotations

from types import SimpleNamespace

from hybridflow.config import load_config
from hybridflow.trainer.lifecycle.run import summary


def _run(history):
    return SimpleNamespace(
        step=4, history={"val": history}, cfg=load_config(), reward_weights={"*": {"rule": 1.0}}
    )


def test_validation_at_two_steps_shows_the_gain_in_points():
    text = summary(_run([(0, {"val/a/mean@4": 0.25}), (4, {"val/a/mean@4": 0.5})]), 10.0)
    assert "val/a/mean@4: step 0 0.250 -> step 4 0.500 (+25.0 points)" in text


def test_validation_once_says_so_and_shows_no_gain():
    text = summary(_run([(4, {"val/a/mean@4": 0.5})]), 10.0)
    assert "validation ran once, at step 4, so there is no gain to show" in text
    assert "val/a/mean@4: 0.500" in text and "points" not in text


def test_no_validation_no_lines():
    assert summary(_run([]), 10.0).splitlines() == [
        f"done: 4 steps in 10 s; metrics in {load_config().trainer.run_dir}"
    ]


def test_a_resumed_run_counts_the_steps_it_trained_and_says_where_it_resumed():
    # resumed at step 6 of 20, it trained 14 steps (it said "done: 20 steps")
    run = SimpleNamespace(step=20, history={"val": []}, reward_weights={"*": {"rule": 1.0}},
                          cfg=load_config(None, ["trainer.total_steps=20"]))  # fmt: skip
    assert summary(run, 30.0, resumed_at=6).splitlines()[0] == (
        "done: 14 steps in 30 s (steps 7 to 20 of 20, resumed from the checkpoint of step 6); "
        f"metrics in {run.cfg.trainer.run_dir}"
    )


def test_a_reward_model_score_is_named_and_its_change_is_no_points():
    run = _run([(0, {"val/a/mean@4": -0.25, "val/reward/model/mean": -0.25}),
                (4, {"val/a/mean@4": 0.5, "val/reward/model/mean": 0.5})])  # fmt: skip
    run.reward_weights = {"*": {"model": 1.0}}
    text = summary(run, 10.0)
    assert "validation score: the reward-model score, not an accuracy" in text
    assert "val/a/mean@4: step 0 -0.250 -> step 4 0.500 (+0.750)" in text and "points" not in text
