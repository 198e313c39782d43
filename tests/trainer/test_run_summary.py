"""The lines a finished run prints: validation before and after, or once without a gain."""

from __future__ import annotations

from types import SimpleNamespace

from hybridflow.config import load_config
from hybridflow.trainer.run import summary


def _run(history):
    return SimpleNamespace(step=4, history={"val": history}, cfg=load_config())


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
