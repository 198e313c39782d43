"""PinnedChoices (choices.py): the file round trip, atomic writes, and what keys it."""

from __future__ import annotations

import json

from hybridflow.engine.choices import (
    PinnedChoices,
    choices_path,
    digest,
    identity,
    pin_recorded_choices,
    recorded_choices,
)
from hybridflow.models.presets import preset_config


def _identity(**options):
    return identity(preset_config("tiny"), "torch.bfloat16", "NVIDIA H200", options,
                    {"torch": "2.11", "triton": "3.6"})  # fmt: skip


def test_choices_survive_a_save_and_load_with_tuples_restored(tmp_path):
    ident = _identity(decode_layer="auto")
    path = choices_path(tmp_path, ident)
    first = PinnedChoices(path, ident)
    first.put("gate_up", (256, 1024, 128, "torch.bfloat16"), ("persistent", (128, 128, 64), 2))
    first.put("gate_up", (16, 1024, 128, "torch.bfloat16"), None)  # cuBLAS
    first.put("decode_layer", (256, 896), "chain")
    first.save()
    assert not first.dirty
    later = PinnedChoices(path, ident)
    assert later.get("gate_up", (256, 1024, 128, "torch.bfloat16")) == (
        "persistent", (128, 128, 64), 2)  # fmt: skip
    assert later.get("gate_up", (16, 1024, 128, "torch.bfloat16"), "missing") is None
    assert later.get("decode_layer", (256, 896)) == "chain"
    assert later.get("decode_layer", (512, 896)) is None
    assert ("decode_layer", (256, 896)) in later
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind


def test_the_file_is_keyed_by_model_gpu_dtype_options_and_versions(tmp_path):
    ident = _identity(decode_layer="auto")
    assert digest(ident) == digest(_identity(decode_layer="auto"))
    others = [
        _identity(decode_layer="split"),
        identity(
            preset_config("qwen2.5-0.5b"),
            "torch.bfloat16",
            "NVIDIA H200",
            {"decode_layer": "auto"},
            {"torch": "2.11", "triton": "3.6"},
        ),  # fmt: skip
        identity(
            preset_config("tiny"),
            "torch.float16",
            "NVIDIA H200",
            {"decode_layer": "auto"},
            {"torch": "2.11", "triton": "3.6"},
        ),  # fmt: skip
        identity(
            preset_config("tiny"),
            "torch.bfloat16",
            "NVIDIA A100",
            {"decode_layer": "auto"},
            {"torch": "2.11", "triton": "3.6"},
        ),  # fmt: skip
        identity(
            preset_config("tiny"),
            "torch.bfloat16",
            "NVIDIA H200",
            {"decode_layer": "auto"},
            {"torch": "2.11", "triton": "3.7"},
        ),  # fmt: skip
    ]
    assert len({digest(i) for i in others} | {digest(ident)}) == len(others) + 1


def test_retune_and_unreadable_or_foreign_files_start_empty(tmp_path):
    ident = _identity()
    path = tmp_path / "c.json"
    saved = PinnedChoices(path, ident)
    saved.put("decode_layer", (16, 64), "split")
    saved.save()
    assert PinnedChoices(path, ident, retune=True).entries == {}
    assert PinnedChoices(path, _identity(decode_layer="split")).entries == {}  # other identity
    path.write_text("{ half a file")
    assert PinnedChoices(path, ident).entries == {}


def test_update_adds_recorded_choices_and_marks_dirty(tmp_path):
    pinned = PinnedChoices(tmp_path / "c.json", {"a": 1})
    pinned.update({"decode_layer:(16, 64)": "lean:qkv"})
    assert pinned.dirty and pinned.get("decode_layer", (16, 64)) == "lean:qkv"
    pinned.save()
    assert json.loads((tmp_path / "c.json").read_text())["choices"] == {
        "decode_layer:(16, 64)": "lean:qkv"}  # fmt: skip
    pinned.update({"decode_layer:(16, 64)": "lean:qkv"})
    assert not pinned.dirty  # nothing new


def test_no_path_keeps_choices_in_memory_only(tmp_path):
    pinned = PinnedChoices()
    pinned.put("decode_layer", (16, 64), "split")
    pinned.save()  # nothing to write, no error
    assert pinned.get("decode_layer", (16, 64)) == "split"


def test_recorded_choices_pin_only_into_an_engine_with_the_same_identity():
    source = PinnedChoices(None, {"a": 1})
    source.put("decode_layer", (16, 64), "lean:qkv")
    recorded = recorded_choices(source)
    foreign = PinnedChoices(None, {"a": 2})
    assert not pin_recorded_choices(foreign, recorded, attention=False)
    assert foreign.entries == {}  # nothing changed
    same = PinnedChoices(None, {"a": 1})
    assert pin_recorded_choices(same, recorded, attention=False)
    assert same.get("decode_layer", (16, 64)) == "lean:qkv"
