"""The same trainer on two CPU processes (backend=local): the hybrid engine with an FSDP2
actor, and split placement (rollout on its own process, weights sent after each update)."""

from __future__ import annotations

import math

import pytest
from trainer_helpers import read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import train


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocate", "split"])
def test_two_process_run(placement, tmp_path, quiet):
    overrides = ["trainer.backend=local", "trainer.n_gpus_per_node=2", "actor.use_kl_loss=true"]
    if placement == "split":
        overrides += ["trainer.placement=split", "trainer.rollout_gpus=1"]
    cfg = tiny_config(tmp_path, *overrides)
    train(cfg, log=quiet)
    row = read_metrics(cfg.trainer.run_dir)[2]
    assert math.isfinite(row["actor/kl_loss"]) and row["actor/grad_norm"] > 0
    assert row["timing_s/sync_weights"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE").is_file()
