"""examples/geo3k.yaml shrunk to two CPU steps of tiny-vl on a Geometry3K-shaped parquet
converted by `hybridflow data geo3k`: the images go through our engine's prefill and the
trainer natively (never the transformers fallback), and the geo3k scorer, picked by the
rows' data source, scores the responses."""

from pathlib import Path

import pytest
from geo3k_helpers import write_hub_parquet
from trainer_helpers import read_metrics

from hybridflow.config import load_config
from hybridflow.data.geo3k import convert_geo3k_file
from hybridflow.trainer.lifecycle.run import train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "geo3k.yaml"


def _no_fallback(*_, **__):
    raise AssertionError("loaded through the transformers fallback")


def test_two_steps_of_the_example_shrunk_to_tiny_vl(tmp_path, quiet, monkeypatch):
    monkeypatch.setattr("hybridflow.models.checkpoint_io.hf_fallback.load_hf_model", _no_fallback)
    data = tmp_path / "data"
    for split, rows in (("train", 4), ("test", 2)):
        hub = write_hub_parquet(tmp_path / "hub" / f"{split}-00000-of-00001.parquet", rows)
        convert_geo3k_file(hub, data)
    cfg = load_config(str(EXAMPLE), [
        "model.path=tiny-vl", "trainer.backend=inprocess", "trainer.n_gpus_per_node=1",
        "trainer.device=cpu", f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'test.parquet'}]", "data.train_batch_size=2",
        "data.val_batch_size=2", "data.max_response_length=8", "rollout.n=2",
        "rollout.val_n=1", "actor.ppo_mini_batch_size=1",  # two mini-batches: old log-probs
        "trainer.total_epochs=null", "trainer.total_steps=2", "trainer.test_freq=2",
        "trainer.save_freq=-1", "trainer.loggers=[jsonl]", f"trainer.run_dir={tmp_path / 'run'}",
        f"trainer.cache_dir={tmp_path / 'cache'}",
    ])  # fmt: skip
    assert cfg.actor.freeze_vision_tower and cfg.actor.kl_loss_type == "low_var_kl"
    train(cfg, log=quiet)
    rows = read_metrics(cfg.trainer.run_dir)
    assert sorted(rows) == [0, 1, 2]
    step = rows[2]
    assert {
        "reward/extra/acc",
        "reward/extra/format",
        "reward/hiyouga/geometry3k/score_mean",
    } <= set(step)
    assert "val/hiyouga/geometry3k/mean@1" in step
    # fp32 on the CPU: the engine's log-probs with the figures are the trainer's
    assert step["rollout_gap/abs_logprob_diff_max"] == pytest.approx(0, abs=1e-4)
