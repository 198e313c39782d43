"""The compile cache (workers/compile_cache.py): Inductor's caches under trainer.cache_dir, a
mega-cache file that an unreadable copy of never stops a run, written atomically."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

from hybridflow.workers import compile_cache as cc

needs_mega_cache = pytest.mark.skipif(
    not cc.mega_cache_available(), reason="torch.compiler.save_cache_artifacts needs torch 2.7+"
)


@pytest.fixture
def inductor_settings(monkeypatch):
    """Whatever a test sets stays in the test: the variable and both config switches."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # recorded: what a test sets is undone
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


def test_inductor_caches_live_under_trainer_cache_dir(tmp_path, monkeypatch, inductor_settings):
    monkeypatch.setenv("HOME", str(tmp_path))
    directory = cc.compile_cache_dir("~/cache")
    assert directory == tmp_path / "cache" / "torch-compile"
    cc.use_compile_cache(directory)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(directory / "inductor")
    assert (directory / "inductor").is_dir()
    assert torch._inductor.config.fx_graph_cache
    assert torch._functorch.config.enable_autograd_cache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(directory / "inductor")  # where Inductor itself will write


def test_a_cache_dir_chosen_in_the_environment_is_kept(tmp_path, monkeypatch, inductor_settings):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    cc.use_compile_cache(tmp_path / "torch-compile")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_the_file_names_the_model():
    one, other = (cc.artifacts_path("/c", model, "cpu") for model in ("/m/a", "/m/b"))
    assert one.parent == other.parent and one != other
    assert cc.artifacts_path("/c", "/m/a", "cpu") == one


@needs_mega_cache
def test_a_corrupt_file_warns_once_and_the_run_goes_on(tmp_path, inductor_settings):
    path = tmp_path / "artifacts-x.bin"
    path.write_bytes(b"\x00not a cache, e.g. a write cut short")
    with pytest.warns(UserWarning, match="unreadable.*compile again") as caught:
        assert cc.load_artifacts(path) is False
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no file yet: nothing to say
        assert cc.load_artifacts(tmp_path / "absent.bin") is False


@needs_mega_cache
def test_a_failure_inside_torch_is_a_warning_too(tmp_path, monkeypatch):
    path = tmp_path / "artifacts-x.bin"
    path.write_bytes(b"anything")

    def broken(data):
        raise EOFError("truncated")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", broken)
    with pytest.warns(UserWarning, match="EOFError: truncated"):
        assert cc.load_artifacts(path) is False


@needs_mega_cache
def test_save_writes_what_torch_serialized(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    assert cc.save_artifacts(tmp_path / "a.bin")
    assert (tmp_path / "a.bin").read_bytes() == b"artifacts"
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)  # nothing compiled
    assert not cc.save_artifacts(tmp_path / "b.bin") and not (tmp_path / "b.bin").exists()


@needs_mega_cache
def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"new" * 1000, None))

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cc.os, "fsync", disk_full)  # after the bytes went into the temporary
    with pytest.warns(UserWarning, match="not written.*No space left"):
        assert cc.save_artifacts(path) is False
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


@needs_mega_cache
def test_the_actor_worker_caches_under_trainer_cache_dir_and_saves_after_its_first_update(
    tmp_path, monkeypatch, inductor_settings
):
    """The wiring, without the minutes a CPU compile would take: the layers stay eager and
    torch's serializer is replaced by one that counts its calls."""
    from test_workers import actor_update, tiny_config

    from hybridflow.controller import WorkerGroup
    from hybridflow.learners import actor_learner
    from hybridflow.workers import fused_worker

    saves = []
    monkeypatch.setattr(actor_learner, "compile_layers", lambda model: None)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts",
                        lambda: saves.append(1) or (b"artifacts", None))  # fmt: skip
    cache = tmp_path / "cache"
    cfg = tiny_config("model.compile=true", f"trainer.cache_dir={cache}")
    group = WorkerGroup(fused_worker(actor=True, rollout=True), config=cfg)
    try:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "torch-compile" / "inductor")
        actor_update(group.actor, group.rollout)
        actor_update(group.actor, group.rollout)
    finally:
        group.shutdown()
    assert len(saves) == 1  # after the first update only
    (saved,) = (cache / "torch-compile").glob("artifacts-*.bin")
    assert saved.read_bytes() == b"artifacts"
