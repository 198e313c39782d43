"""The background writer: a host copy independent of the live tensors, reused by the next
save of the same layout, files equal to a blocking write's, and errors raised with the path."""

from __future__ import annotations

import pytest
import torch

import hybridflow.learners.state_writer as state_writer
from hybridflow.dcp_reader import load_state
from hybridflow.learners.state_writer import StateWriter, stage_to_host


def optimizer_like_state(scale: float = 1.0) -> dict:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3) * scale},
        "optimizer": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}},
                      "param_groups": [{"lr": 0.1 * scale, "params": ["w"]}]},
    }  # fmt: skip


def test_the_host_copy_does_not_follow_the_live_tensors_and_is_reused():
    live = optimizer_like_state()
    staged = stage_to_host(live)
    live["model"]["w"].add_(100.0)  # the next optimizer step, in place
    assert torch.equal(staged["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert staged["model"]["w"].data_ptr() != live["model"]["w"].data_ptr()

    writer = StateWriter(None, distributed=False)
    first = writer._stage(optimizer_like_state())
    second = writer._stage(optimizer_like_state(scale=2.0))
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # same buffer
    assert torch.equal(second["model"]["w"], torch.arange(6.0).reshape(2, 3) * 2)
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.2  # plain values are the new ones
    bigger = {"model": {"w": torch.zeros(4, 3)}}
    assert writer._stage(bigger)["model"]["w"].shape == (4, 3)  # another layout: a new copy


def test_a_background_write_equals_a_blocking_one(tmp_path, recwarn):
    writer = StateWriter(None, distributed=False)
    for name, background in (("blocking", False), ("background", True)):
        directory = tmp_path / name
        directory.mkdir()
        writer.write(optimizer_like_state(), directory, {"update_count": 7},
                     directory / "extra_rank0.pt", background=background)  # fmt: skip
        writer.wait()
        assert writer.finished()
    for name in ("blocking", "background"):
        loaded = {"model": {"w": torch.zeros(2, 3)}}
        load_state(loaded, tmp_path / name)
        assert torch.equal(loaded["model"]["w"], torch.arange(6.0).reshape(2, 3))
        assert torch.load(tmp_path / name / "extra_rank0.pt") == {"update_count": 7}
    # torch's "assuming the intent is to save in a single process", on every one-process save
    assert not [w for w in recwarn if "torch.distributed is" in str(w.message)]


def test_a_failed_background_write_is_raised_once_with_its_directory(tmp_path, monkeypatch):
    def failing(state, directory, *args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(state_writer, "_write_files", failing)
    writer = StateWriter(None, distributed=False)
    writer.write(optimizer_like_state(), tmp_path, {}, tmp_path / "extra.pt", background=True)
    with pytest.raises(RuntimeError, match=f"writing {tmp_path} failed: .*Input/output error"):
        writer.wait()
    assert writer.finished()  # reported once; the next save starts clean
