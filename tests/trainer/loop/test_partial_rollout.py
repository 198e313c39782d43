"""Partial rollouts (trainer.partial_rollout, trainer/loop/async_rollout.py): a request in flight
continues across a weight sync, its tokens record both versions, and no trained sample lags
more than trainer.max_staleness versions; stale_policy=drop discards and replaces the prompt
groups beyond the bound; the settings are checked."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from trainer_helpers import read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import train
from hybridflow.trainer.loop import async_rollout, rl_loop
from hybridflow.trainer.loop.staleness import oldest_versions

PARTIAL = ("trainer.mode=async", "trainer.partial_rollout=true", "trainer.val_before_train=false",
           "trainer.save_freq=-1", "rollout.engine.steps_per_sync=1")  # fmt: skip


def _sync_lands_during_second_rollout(monkeypatch) -> None:
    """Make the weight sync after step 1 arrive while the rollout of step 2 decodes, whatever
    the timing: that sync waits until the rollout has decoded one chunk, and the engine
    waits after that chunk until the sync is queued (it then runs between two chunks)."""
    from hybridflow.engine.serving.service import RolloutService

    generations, first_chunk = [], threading.Event()
    real_generate, real_step, real_sync = (RolloutService.generate, RolloutService._step,
                                           rl_loop.sync_weights)  # fmt: skip

    def generate(self, *args, **kwargs):
        generations.append(1)
        return real_generate(self, *args, **kwargs)

    def step(self):
        real_step(self)
        if len(generations) == 2 and not first_chunk.is_set():
            first_chunk.set()
            deadline = time.monotonic() + 30
            while not self._inbox and time.monotonic() < deadline:
                time.sleep(0.001)

    def sync_weights(roles, version=None):
        if version == 1:
            assert first_chunk.wait(30), "the rollout of step 2 did not start"
        real_sync(roles, version)

    monkeypatch.setattr(RolloutService, "generate", generate)
    monkeypatch.setattr(RolloutService, "_step", step)
    monkeypatch.setattr(rl_loop, "sync_weights", sync_weights)


def _trained_batches(monkeypatch) -> dict:
    """step -> the batch the trainer took from the producer."""
    taken, real_take = {}, async_rollout.RolloutProducer.take

    def take(self, step):
        batch, metrics, version = real_take(self, step)
        taken[step] = batch
        return batch, metrics, version

    monkeypatch.setattr(async_rollout.RolloutProducer, "take", take)
    return taken


def test_a_sample_spans_two_versions_and_none_lags_beyond_the_bound(tmp_path, monkeypatch):
    _sync_lands_during_second_rollout(monkeypatch)
    taken = _trained_batches(monkeypatch)
    cfg = tiny_config(tmp_path, "trainer.total_steps=3", "trainer.max_staleness=1", *PARTIAL)
    train(cfg, log=lambda *a, **k: None)

    def versions_of_rows(batch):
        mask = batch.tensors["response_mask"].bool()
        return [set(row[keep].tolist()) for row, keep in zip(batch.tensors["token_versions"], mask)]

    assert {0, 1} in versions_of_rows(taken[2])  # decoded across the sync after step 1
    assert all(len(versions) == 1 for versions in versions_of_rows(taken[1]))
    for step, batch in taken.items():
        oldest = oldest_versions(batch.tensors["token_versions"], batch.tensors["response_mask"])
        assert int((step - 1 - oldest).max()) <= 1  # the bound, from the recorded versions
    metrics = read_metrics(cfg.trainer.run_dir)
    assert metrics[2]["async/staleness_max"] == 1 and 0 < metrics[2]["async/token_lag_1"] < 1
    assert metrics[2]["async/token_lag_0"] + metrics[2]["async/token_lag_1"] == pytest.approx(1)
    assert metrics[2]["async/rollout_is_ratio_max"] > 1


def test_drop_discards_and_replaces_the_groups_beyond_the_bound(tmp_path, monkeypatch):
    """s=0, drop: step 2's rollout starts with version 0 (one early); its first tokens are
    sampled before the sync of version 1, so all 4 of its groups lag by 1 and are dropped,
    then replaced by groups sampled with version 1."""
    _sync_lands_during_second_rollout(monkeypatch)
    taken = _trained_batches(monkeypatch)
    cfg = tiny_config(tmp_path, "trainer.total_steps=3", "trainer.max_staleness=0",
                      "trainer.stale_policy=drop", *PARTIAL)  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    metrics = read_metrics(cfg.trainer.run_dir)
    assert metrics[1]["async/dropped_groups"] == 0 and metrics[2]["async/dropped_groups"] == 4
    assert all(metrics[step]["async/staleness_max"] == 0 for step in (1, 2, 3))
    replaced = taken[2]
    assert len(replaced) == 16 and len(set(replaced.arrays["uid"])) == 4
    assert all(uid.startswith("2.1.") for uid in replaced.arrays["uid"])  # the second attempt
    mask = replaced.tensors["response_mask"].bool()
    assert torch.all(replaced.tensors["token_versions"][mask] == 1)


def _engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "hybridflow-engine"}


def test_an_inprocess_run_stops_its_engine_thread_at_the_end(tmp_path):
    """The group's shutdown closes the rollout's RolloutService (RolloutWorker.close): no
    engine thread, holding the model, outlives the run in the controller's process."""
    before = _engine_threads()
    cfg = tiny_config(tmp_path, "trainer.total_steps=2", "trainer.max_staleness=1", *PARTIAL)
    started = []
    from hybridflow.engine.serving.service import RolloutService

    real_init = RolloutService.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.append(self._thread)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RolloutService, "__init__", init)
        train(cfg, log=lambda *a, **k: None)
    assert started and started[0].name == "hybridflow-engine"  # the run had a service
    assert not any(thread.is_alive() for thread in started)
    assert _engine_threads() <= before


def test_partial_rollout_settings_are_checked():
    from hybridflow.config import ConfigError, load_config, validate

    def problems(*overrides):
        with pytest.raises(ConfigError) as error:
            validate(load_config(None, list(overrides)))
        return str(error.value)

    assert "trainer.partial_rollout = true needs trainer.mode = async" in problems(
        "trainer.partial_rollout=true"
    )
    assert "trainer.stale_policy = 'later' is unknown" in problems(
        "trainer.mode=async", "trainer.partial_rollout=true", "trainer.stale_policy=later"
    )
    assert "trainer.stale_policy = drop needs" in problems(
        "trainer.mode=async", "trainer.stale_policy=drop"
    )
    validate(load_config(None, ["trainer.mode=async", "trainer.partial_rollout=true",
                                "trainer.stale_policy=drop"]))  # fmt: skip


def test_partial_rollout_without_async_exits_2_through_the_cli(tmp_path, capsys):
    from hybridflow.cli import main

    status = main(["train", "trainer.partial_rollout=true", f"trainer.run_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert status == 2 and "trainer.partial_rollout" in err and "Traceback" not in err


def test_partial_rollouts_on_the_local_backend_stay_within_the_bound(tmp_path, monkeypatch):
    """Worker processes: the generation runs on a thread of the rollout worker while the
    trainer's calls (its weight syncs) reach it between short waits; every trained sample,
    by its recorded token versions, lags at most s = 1 versions."""
    taken = _trained_batches(monkeypatch)
    cfg = tiny_config(tmp_path, "trainer.total_steps=3", "trainer.max_staleness=1",
                      "trainer.backend=local", *PARTIAL)  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    assert sorted(taken) == [1, 2, 3]
    for step, batch in taken.items():
        mask = batch.tensors["response_mask"].bool()
        versions = batch.tensors["token_versions"][mask]
        assert int(versions.min()) >= step - 2 and int(versions.max()) <= step - 1
    metrics = read_metrics(cfg.trainer.run_dir)
    assert all(metrics[step]["async/staleness_max"] <= 1 for step in (1, 2, 3))


def test_drop_starts_one_version_early_except_after_a_checkpoint():
    from hybridflow.trainer.loop.async_rollout import RolloutProducer

    def producer(stale_policy, save_steps):  # steps 1..0: its thread has nothing to do
        return RolloutProducer(lambda step, attempt: None, 1, 0, 1, save_steps, installed=0,
                               timeout_s=1, partial=True, stale_policy=stale_policy)  # fmt: skip

    never, every_3 = (lambda step: False), (lambda step: step % 3 == 0)
    assert [producer("wait", never).start_version(j) for j in range(1, 7)] == [0, 0, 1, 2, 3, 4]
    assert [producer("drop", never).start_version(j) for j in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    # step 4 follows the checkpoint of step 3: it waits for version 3 under either policy
    assert [producer("drop", every_3).start_version(j) for j in range(1, 7)] == [0, 0, 0, 3, 3, 3]


def test_prompts_with_images_decode_across_a_sync_and_their_replacements_keep_them(
    tmp_path, monkeypatch, quiet
):
    """examples/geo3k.yaml shrunk to tiny-vl, async with partial rollouts, s=0 and drop:
    step 2's rollout (prompts with images) is cut by the sync of version 1, its groups
    dropped and replaced by groups sampled with version 1, which keep their images and
    their mRoPE rows beside their tokens; the run trains on them."""
    from pathlib import Path

    from geo3k_helpers import write_hub_parquet

    from hybridflow.config import load_config
    from hybridflow.data.geo3k import convert_geo3k_file
    from hybridflow.data.image_batch import IMAGE_GRID_THW, MROPE_POSITIONS

    _sync_lands_during_second_rollout(monkeypatch)
    taken = _trained_batches(monkeypatch)
    data = tmp_path / "data"
    hub = write_hub_parquet(tmp_path / "hub" / "train-00000-of-00001.parquet", 4)
    convert_geo3k_file(hub, data)
    example = Path(__file__).resolve().parents[3] / "examples" / "geo3k.yaml"
    cfg = load_config(str(example), [
        "model.path=tiny-vl", "trainer.backend=inprocess", "trainer.n_gpus_per_node=1",
        "trainer.device=cpu", f"data.train_files=[{data / 'train.parquet'}]",
        "data.val_files=[]", "data.train_batch_size=2", "data.max_response_length=8",
        "rollout.n=2", "actor.ppo_mini_batch_size=2", "trainer.total_epochs=null",
        "trainer.total_steps=3", "trainer.test_freq=-1", "trainer.loggers=[jsonl]",
        f"trainer.run_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path / 'cache'}",
        "trainer.max_staleness=0", "trainer.stale_policy=drop", *PARTIAL,
    ])  # fmt: skip
    train(cfg, log=quiet)
    metrics = read_metrics(cfg.trainer.run_dir)
    assert sorted(metrics) == [1, 2, 3] and metrics[2]["async/dropped_groups"] == 2
    replaced = taken[2]
    mask = replaced.tensors["response_mask"].bool()
    assert torch.all(replaced.tensors["token_versions"][mask] == 1)
    assert all(len(grid) for grid in replaced.arrays[IMAGE_GRID_THW])
    positions = replaced.tensors[MROPE_POSITIONS]  # [B, 3, P+R], 0 where attention_mask is
    assert positions.shape[-1] == replaced.tensors["attention_mask"].shape[-1]
    assert torch.all(positions.amax(1)[replaced.tensors["attention_mask"] == 0] == 0)
