"""Checkpoint files: a checksum per file written at save and verified at load, so same-size
damage (random or zeroed bytes) is found and resuming falls back; earlier versions'
checkpoints without checksums still load (said once); pruning never deletes the newest
checkpoint known good; links are listed, never followed."""

from __future__ import annotations

import json
import os
import zlib

import pytest

from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager, load_newest_intact
from hybridflow.trainer.lifecycle.checkpoint_files import checksum, damage, irregular_entries


def write_shards(step: int):
    def writer(directory):
        (directory / "actor").mkdir()
        for shard in range(2):
            (directory / "actor" / f"__0_{shard}.distcp").write_bytes(bytes([step, shard]) * 5000)
        (directory / "trainer_state.pt").write_bytes(b"state %d" % step)

    return writer


def saved(tmp_path, steps, keep_last_k=None) -> CheckpointManager:
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last_k=keep_last_k)
    for step in steps:
        manager.save(step, write_shards(step))
    return manager


def overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def test_each_file_gets_a_checksum_that_verifies(tmp_path):
    step = saved(tmp_path, [1]).step_dir(1)
    info = json.loads((step / "metadata.json").read_text())
    assert set(info["checksums"]) == set(info["files"]) == {
        "actor/__0_0.distcp", "actor/__0_1.distcp", "trainer_state.pt"}  # fmt: skip
    shard = step / "actor" / "__0_1.distcp"
    assert info["checksums"]["actor/__0_1.distcp"] == f"crc32:{zlib.crc32(shard.read_bytes()):08x}"
    assert damage(step) == []


def test_the_checksum_reads_the_whole_file_across_chunks(tmp_path):
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    assert checksum(tmp_path / "f", chunk_bytes=4096) == f"crc32:{zlib.crc32(data):08x}"


@pytest.mark.parametrize("harm", [os.urandom(64), bytes(64)], ids=["random_bytes", "zeroed_bytes"])
def test_same_size_damage_is_found_and_named(tmp_path, harm):
    step = saved(tmp_path, [1]).step_dir(1)
    shard = step / "actor" / "__0_0.distcp"
    size = shard.stat().st_size
    overwrite(shard, 1000, harm)
    assert shard.stat().st_size == size
    [problem] = damage(step)
    assert problem.startswith("actor/__0_0.distcp has other content than when saved (checksum")


def test_resume_falls_back_past_same_size_damage(tmp_path):
    manager = saved(tmp_path, [1, 2])
    overwrite(manager.step_dir(2) / "actor" / "__0_1.distcp", 0, bytes(100))
    loaded, messages = [], []
    path = load_newest_intact(manager, "auto", loaded.append, messages.append)
    assert path == loaded[0] == manager.step_dir(1) and manager.verified == path
    assert "step_2 is damaged (actor/__0_1.distcp has other content" in messages[0]
    assert "trying the previous one" in messages[0]


def test_checkpoints_of_earlier_versions_without_checksums_load_and_it_is_said_once(tmp_path):
    manager = saved(tmp_path, [1, 2])
    for _, step in manager.complete_checkpoints():
        info = json.loads((step / "metadata.json").read_text())
        del info["checksums"]
        (step / "metadata.json").write_text(json.dumps(info))
    overwrite(manager.step_dir(2) / "trainer_state.pt", 0, b"S")  # unseen without checksums
    assert damage(manager.step_dir(2)) == []
    messages = []
    assert load_newest_intact(manager, "auto", lambda p: None, messages.append) == manager.step_dir(
        2
    )
    assert messages == [
        f"{manager.step_dir(2)} was saved by an earlier version, without content checksums: "
        "only its file sizes are checked"
    ]


def test_pruning_never_deletes_the_newest_checkpoint_known_good(tmp_path):
    """Steps 2 and 3 damaged: the run resumes from step 1 and saves step 2 again. The newest
    keep_last_k=1 is the damaged step 3, yet the fresh step 2 stays (it is the newest good one),
    and step 1 goes only because of it."""
    saved(tmp_path, [1, 2, 3])
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last_k=1)
    for step in (2, 3):
        overwrite(manager.step_dir(step) / "actor" / "__0_0.distcp", 10, os.urandom(8))
    assert load_newest_intact(manager, "auto", lambda p: None, lambda m: None) == manager.step_dir(
        1
    )
    manager.save(2, write_shards(2))
    assert [s for s, _ in manager.complete_checkpoints()] == [2, 3]
    assert damage(manager.step_dir(2)) == [] and damage(manager.step_dir(3)) != []
    assert load_newest_intact(manager, "auto", lambda p: None, lambda m: None) == manager.step_dir(
        2
    )


def test_links_and_special_files_are_listed_not_followed(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "ok.bin").write_bytes(b"1")
    (tmp_path / "data" / "secret").symlink_to("/etc/passwd")
    (tmp_path / "folder").symlink_to(tmp_path / "data", target_is_directory=True)
    os.mkfifo(tmp_path / "pipe")
    assert irregular_entries(tmp_path) == [
        "data/secret (a link to /etc/passwd)",
        f"folder (a link to {tmp_path / 'data'})",
        "pipe (not a regular file)",
    ]
