"""The sliding layers' ring (engine/cache/window.py): which position each entry holds, a
prompt's last window stored without two writes to one entry, and its price, the memory
plan's for a sequence past the window; a window past max_seq_len keeps max_seq_len."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hybridflow.engine.cache.window import (
    ring_length,
    ring_positions,
    store_last_positions,
    window_spec,
)
from hybridflow.models.presets import PRESETS


def test_ring_positions():
    got = ring_positions(torch.tensor([-1, 2, 9]), 4)
    assert got.tolist() == [[-4, -3, -2, -1], [0, 1, 2, -1], [8, 9, 6, 7]]


def test_a_prompt_longer_than_the_window_keeps_its_last_window():
    """10 positions of slot 1 into rings of 4: positions 6..9 at entries p % 4; the earlier
    ones to the scratch slot; slot 0 untouched."""
    keys, values = torch.zeros(3, 4, 1, 2), torch.zeros(3, 4, 1, 2)
    positions = torch.arange(10)
    k = positions.float()[:, None, None].expand(10, 1, 2)
    store_last_positions((keys, values), k, -k, torch.ones(10, dtype=torch.long), positions,
                         torch.full((10,), 9), scratch=2)  # fmt: skip
    assert keys[1, :, 0, 0].tolist() == [8, 9, 6, 7]
    assert values[1, :, 0, 1].tolist() == [-8, -9, -6, -7]
    assert keys[0].abs().sum() == 0


def test_the_ring_and_the_full_layers_cost_what_the_memory_plan_prices():
    arch = PRESETS["gpt-oss-20b"]
    spec = window_spec(arch, torch.bfloat16, 4096)
    assert spec.layers == tuple(range(0, 24, 2)) and spec.window == 128
    full = 12 * 2 * arch.num_key_value_heads * arch.head_dim * 2  # a token's K/V, 12 layers
    for seq_len in (128, 4096):
        expected = arch.cache_bytes_per_sequence(seq_len)
        assert spec.bytes_per_sequence + full * seq_len == expected
    assert window_spec(PRESETS["tiny"], torch.bfloat16, 4096) is None


@pytest.mark.parametrize("window", [4096, 131072, 10**6, 2**31 - 1])
def test_a_ring_holds_at_most_max_seq_len_positions(window):
    """A window no sequence of max_seq_len fills keeps a ring of max_seq_len (the whole
    sequence, never wrapping), priced as the memory plan prices it; a shorter one its own."""
    arch = replace(PRESETS["gpt-oss-20b"], attention_window=window)
    spec = window_spec(arch, torch.bfloat16, 4096)
    assert spec.window == ring_length(window, 4096) == 4096
    assert spec.bytes_per_sequence == 12 * 4096 * 2 * 8 * 64 * 2
    full = 12 * 2 * 8 * 64 * 2 * 4096
    assert spec.bytes_per_sequence + full == arch.cache_bytes_per_sequence(4096)
    rings = spec.allocate(2, torch.device("meta"))
    assert rings.keys.shape == (12, 3, 4096, 8, 64) and rings.window == 4096
    assert window_spec(arch, torch.bfloat16, 100).window == ring_length(window, 100) == 100
