"""DecodeLayerChooser (chooser.py): which decode layers are considered for each option, the
timing once per bucket with the chain's margin, and pinned decisions (CPU, timing faked)."""

from __future__ import annotations

import torch

from hybridflow.engine.choices import PinnedChoices
from hybridflow.engine.layers import chooser as chooser_module
from hybridflow.engine.layers.chooser import DecodeLayerChooser, pick_fastest

LEAN = ["lean:qkv+mlp", "lean:qkv", "lean:mlp"]
BOTH = {"chain": True, "lean": True}


def test_wanted_layers_follow_the_option_and_what_applies():
    assert DecodeLayerChooser("auto").wanted(BOTH) == ["split", "chain", *LEAN]
    assert DecodeLayerChooser("auto").wanted({"chain": False, "lean": True}) == ["split", *LEAN]
    assert DecodeLayerChooser("split").wanted(BOTH) == ["split"]
    assert DecodeLayerChooser("chain").wanted(BOTH) == ["chain"]
    assert DecodeLayerChooser("chain").wanted({"chain": False}) == ["split"]  # falls back
    assert DecodeLayerChooser("lean").wanted(BOTH) == LEAN
    assert DecodeLayerChooser("lean:qkv").wanted(BOTH) == ["lean:qkv"]
    assert DecodeLayerChooser("lean:qkv").wanted({"lean": False}) == ["split"]


def test_the_chain_must_beat_split_by_its_margin():
    assert pick_fastest({"split": 100.0, "chain": 98.5, "lean:qkv": 99.0}) == "lean:qkv"
    assert pick_fastest({"split": 100.0, "chain": 97.9, "lean:qkv": 99.0}) == "chain"
    assert pick_fastest({"split": 100.0, "lean:qkv": 100.5}) == "split"
    assert pick_fastest({"lean:qkv": 3.0, "lean:mlp": 2.0}) == "lean:mlp"  # no split: fastest


def _fake_timing(monkeypatch, times):
    timed = []

    def fake_time(fn, calls, replays):
        timed.append(fn())
        return times[timed[-1]]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    from hybridflow.engine.kernels import gemm

    monkeypatch.setattr(gemm, "graph_time_us", fake_time)
    return timed


def test_choose_times_each_bucket_once_and_pins_the_decision(monkeypatch, tmp_path):
    times = {"split": 100.0, "chain": 98.5, "lean:qkv+mlp": 99.0, "lean:qkv": 101.0}
    timed = _fake_timing(monkeypatch, times)
    candidates = {name: (lambda name=name: name) for name in times}
    pinned = PinnedChoices(tmp_path / "choices.json", {"model": "tiny"})
    chooser = DecodeLayerChooser("auto", pinned)
    assert chooser.choose(200, 64, candidates) == "lean:qkv+mlp"  # chain 1.5% faster: too little
    assert chooser.choose(250, 64, candidates) == "lean:qkv+mlp"  # same bucket: no new timing
    assert sorted(timed) == sorted(times)
    pinned.save()
    # a later process with the same file: the same layer, nothing timed, even where timing
    # would now pick another one
    timed.clear()
    times["chain"] = 50.0
    later = DecodeLayerChooser("auto", PinnedChoices(tmp_path / "choices.json", {"model": "tiny"}))
    assert later.choose(200, 64, candidates) == "lean:qkv+mlp" and timed == []
    # retune: timed again
    fresh = PinnedChoices(tmp_path / "choices.json", {"model": "tiny"}, retune=True)
    assert DecodeLayerChooser("auto", fresh).choose(200, 64, candidates) == "chain"


def test_a_pinned_layer_that_is_not_a_candidate_is_timed_again(monkeypatch):
    timed = _fake_timing(monkeypatch, {"split": 2.0, "lean:qkv": 1.0})
    pinned = PinnedChoices()
    pinned.put("decode_layer", (256, 64), "chain")  # e.g. made before fuse_projections changed
    candidates = {"split": lambda: "split", "lean:qkv": lambda: "lean:qkv"}
    assert DecodeLayerChooser("auto", pinned).choose(256, 64, candidates) == "lean:qkv"
    assert sorted(timed) == ["lean:qkv", "split"]
    assert pinned.get("decode_layer", (256, 64)) == "lean:qkv"


def test_one_candidate_is_never_timed(monkeypatch):
    timed = _fake_timing(monkeypatch, {})
    assert DecodeLayerChooser("split").choose(8, 64, {"split": lambda: "split"}) == "split"
    assert timed == [] and chooser_module.MARGINS["chain"] == 0.02
