"""Cache kinds read off the layer specs (engine/cache/kinds.py): which layers keep K/V and
which a recurrent state, what a state costs (the memory plan's price), and why a model whose
kinds have no cache yet takes the slow path."""

from __future__ import annotations

import torch

from hybridflow.engine.cache.kinds import (
    engine_gaps,
    kv_layer_rows,
    layers_by_kind,
    recurrent_state_spec,
)
from hybridflow.models.layer_spec import LayerSpec
from hybridflow.models.presets import PRESETS


def test_layers_by_kind_and_kv_rows_of_a_hybrid():
    specs = PRESETS["qwen3.5-4b"].layer_specs()
    kinds = layers_by_kind(specs)
    assert kinds["kv"] == tuple(range(3, len(specs), 4))
    assert len(kinds["recurrent"]) == 3 * len(kinds["kv"])
    rows = kv_layer_rows(specs)
    assert rows[:8] == [None, None, None, 0, None, None, None, 1]


def test_a_states_bytes_are_what_the_memory_plan_prices():
    for name in ("tiny-hybrid", "qwen3.5-4b", "qwen3.5-35b-a3b"):
        arch = PRESETS[name]
        spec = recurrent_state_spec(arch, torch.bfloat16)
        assert spec.bytes_per_sequence == arch.recurrent_state_bytes(2), name
    assert recurrent_state_spec(PRESETS["tiny"], torch.bfloat16) is None


def test_sliding_layers_keep_no_rows_of_the_kv_cache():
    specs = PRESETS["gpt-oss-20b"].layer_specs()
    rows = kv_layer_rows(specs)
    assert rows[:4] == [None, 0, None, 1]  # sliding first, then full, alternating
    assert layers_by_kind(specs)["kv"] == tuple(range(24))  # both keep K/V, of two extents


def test_kinds_without_a_cache_are_named():
    assert engine_gaps(PRESETS["qwen3.5-4b"].layer_specs()) == []
    assert engine_gaps(PRESETS["deepseek-v3"].layer_specs()) == []  # the latent kind
    assert engine_gaps([LayerSpec("sink_attention", "biased_experts", window=128)]) == []
    assert engine_gaps(
        [LayerSpec("sink_attention", window=128), LayerSpec("sink_attention", window=64)]
    ) == ["sliding windows of several sizes [64, 128]: one ring size expected"]
    assert engine_gaps([LayerSpec("attention", window=64)]) == [
        "attention layers with a 64-token window: no windowed cache kind yet"
    ]
