"""Sink attention in the engine's passes (engine/layers/sink.py) against the model's
(models/mixers/sink_attention.py): the gathered-keys softmax with sinks, and a sliding
layer's extend over its ring plus the pass's own tokens, for tokens split across passes."""

from __future__ import annotations

import torch

from hybridflow.engine.cache.window import store_last_positions
from hybridflow.engine.layers.sink import (
    _runs,
    sink_prefill_attention,
    sink_softmax,
    windowed_extend_attention,
)
from hybridflow.models.mixers.sink_attention import sink_attention_packed, sink_attention_rows

HEADS, KV_HEADS, DIM, WINDOW = 4, 2, 8, 5


def _qkv(length: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(length, HEADS, DIM, generator=generator)
    k, v = (torch.randn(length, KV_HEADS, DIM, generator=generator) for _ in range(2))
    return q, k, v, torch.randn(HEADS, generator=generator)


def test_sink_softmax_is_the_models_attention_for_a_full_prefix():
    q, k, v, sinks = _qkv(7, 1)
    expected = sink_attention_rows(q[None], k[None], v[None], sinks, 0)[0]
    visible = torch.arange(7)[None, :] <= torch.arange(7)[:, None]
    got = sink_softmax(q, k[None].expand(7, -1, -1, -1), v[None].expand(7, -1, -1, -1),
                       visible, sinks)  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    shared = sink_softmax(q, k, v, visible, sinks)  # the same keys for every row
    torch.testing.assert_close(shared, expected, rtol=1e-6, atol=1e-6)


def test_prefill_in_row_blocks_is_the_models_packed_attention():
    """Two prompts of 23 and 9 tokens packed; row blocks of 3 queries (a score budget of
    3 x heads x span x 2): a sliding layer's blocks read a window's keys past the block."""
    q, k, v, sinks = _qkv(32, 2)
    cu = torch.tensor([0, 23, 32], dtype=torch.int32)
    for window in (WINDOW, 0):
        expected = sink_attention_packed(q, k, v, sinks, window, cu)
        span = WINDOW if window else 23
        got = sink_prefill_attention(q, k, v, sinks, window, cu, scores=3 * HEADS * span * 2)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_runs_of_slots():
    starts, ends = _runs(torch.tensor([3, 3, 3, 0, 5, 5]))
    assert starts.tolist() == [0, 0, 0, 3, 4, 4] and ends.tolist() == [2, 2, 2, 3, 5, 5]


def test_a_sliding_layers_extend_passes_give_the_models_attention():
    """Two sequences of 13 and 4 tokens in slots 1 and 0, run as three passes (the first
    longer than the window, then a chunk of 3 and of 6, then single tokens): each pass
    attends over the ring the previous left, the ring keeps the last window."""
    lengths = {1: 13, 0: 4}
    data = {slot: _qkv(n, 10 + slot) for slot, n in lengths.items()}
    sinks = data[1][3]
    ring = (torch.zeros(3, WINDOW, KV_HEADS, DIM), torch.zeros(3, WINDOW, KV_HEADS, DIM))
    cuts = {1: [0, 7, 10, 11, 12, 13], 0: [0, 1, 4, 4, 4, 4]}
    got = {1: [], 0: []}
    for part in range(5):
        slots, positions, qs, ks, vs = [], [], [], [], []
        for slot in (1, 0):
            lo, hi = cuts[slot][part], cuts[slot][part + 1]
            q, k, v, _ = data[slot]
            slots += [slot] * (hi - lo)
            positions += range(lo, hi)
            qs.append(q[lo:hi]), ks.append(k[lo:hi]), vs.append(v[lo:hi])
        slots, positions = torch.tensor(slots), torch.tensor(positions)
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        starts, ends = _runs(slots)
        out = windowed_extend_attention(q, k, v, ring, slots, positions, starts, WINDOW, sinks,
                                        rows_per_pass=4)  # fmt: skip
        store_last_positions(ring, k, v, slots, positions, positions[ends], scratch=2)
        for slot in (1, 0):
            got[slot].append(out[slots == slot])
    for slot, (q, k, v, _) in data.items():
        expected = sink_attention_rows(q[None], k[None], v[None], sinks, WINDOW)[0]
        torch.testing.assert_close(torch.cat(got[slot]), expected, rtol=1e-5, atol=1e-5)
