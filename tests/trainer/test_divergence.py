"""A loss or gradient norm that is NaN or inf stops a run (RL and SFT) with exit 2 and a
message; the step is not saved, the checkpoint before it stays the newest."""

from __future__ import annotations

import json
import math

import pytest
from trainer_helpers import TINY

from hybridflow.cli import main
from hybridflow.trainer.lifecycle.divergence import non_finite_update


def test_finite_update_metrics_pass():
    metrics = {"actor/pg_loss": 0.3, "actor/kl_loss": 0.0, "actor/grad_norm": 1.2,
               "actor/skipped_steps": 0.0, "critic/vf_loss": math.nan}  # fmt: skip
    assert non_finite_update(metrics, "actor") is None  # another role's NaN is its own


@pytest.mark.parametrize(
    "metrics, said",
    [
        ({"actor/pg_loss": math.nan}, "actor/pg_loss = nan"),
        ({"actor/pg_loss": 0.1, "actor/kl_loss": math.inf}, "actor/kl_loss = inf"),
        ({"actor/pg_loss": 0.1, "actor/skipped_steps": 2.0}, "NaN or inf in 2 optimizer"),
        ({"critic/vf_loss": -math.inf}, "critic/vf_loss = -inf"),
    ],
)
def test_a_non_finite_loss_or_a_skipped_step_is_named(metrics, said):
    prefix = next(iter(metrics)).split("/")[0]
    assert said in non_finite_update(metrics, prefix)


def _run(capsys, command: list[str]) -> str:
    status = main(command)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_a_diverging_rl_run_stops_and_keeps_the_last_checkpoint(capsys, tmp_path, estimator):
    # lr 1e30: step 1 moves the weights to ~1e30, so step 2's logits overflow to NaN
    run = tmp_path / "run"
    role = "critic" if estimator == "gae" else "actor"
    err = _run(capsys, ["train", *TINY, f"trainer.run_dir={run}",
                        f"trainer.cache_dir={tmp_path / 'cache'}", "trainer.total_steps=4",
                        "trainer.save_freq=1", f"algorithm.adv_estimator={estimator}",
                        "actor.lr=1e30", "critic.lr=1e30"])  # fmt: skip
    assert f"error: step 2: the {role} update is not finite ({role}/" in err
    assert f"the checkpoint of step 1 in {run / 'checkpoints'} is the newest and is kept" in err
    assert f"a lower {role}.lr" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 2 not in steps  # the diverged step is neither logged nor saved


def test_a_diverging_sft_run_stops_and_keeps_the_last_checkpoint(capsys, tmp_path):
    run = tmp_path / "run"
    err = _run(capsys, ["sft", "model.path=tiny", "trainer.device=cpu", f"trainer.run_dir={run}",
                        "sft.total_steps=4", "sft.batch_size=4", "sft.lr=1e30",
                        "trainer.save_freq=1", "trainer.loggers=[jsonl]"])  # fmt: skip
    assert "error: SFT step 2: the sft update is not finite (sft/loss = nan" in err
    assert f"the checkpoint of step 1 in {run / 'sft' / 'checkpoints'} is the newest" in err
    assert sorted(p.name for p in (run / "sft" / "checkpoints").iterdir()) == ["step_1"]
    assert not (run / "sft" / "hf").exists()
