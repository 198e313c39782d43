"""The mixed step's chunk attention (kernels/chunk_attention.py) against a torch reference
over gathered K/V: chunks of a paged cache (through the block table) and of a slot cache,
tiles cut at odd places, a kept prefix before a chunk, GQA groups of 2 and 3, and padding
tokens that come out zero while the rows past a chunk's end are left alone. Then packed
prompts attending over their own K/V with a sink logit per head and a sliding window (a
GPT-OSS prefill) against the model's packed sink attention, a window no prompt fills as
full attention. Over an FP8 KV cache: e4m3 K/V dequantized with their scales."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

from hybridflow.engine.kernels.chunk_attention import (
    chunk_attention,
    chunk_attention_reference,
    chunk_tiles,
    tile_count,
    tile_tokens,
)

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
SEQ, KV_HEADS, DIM = 64, 2, 16


def _step(heads: int, paged: bool, generator, per_tile: int | None = None):
    """Three chunks (slot, cached, new) packed into a 40-token budget, the rest padding;
    tiles of per_tile tokens (at most the kernel's tile_tokens; default: that)."""
    chunks = [(3, 0, 11), (0, 17, 6), (5, 30, 9)]  # a fresh prompt, two continuations
    tokens = 40
    slots = 7
    keys, values = (torch.randn(slots, SEQ, KV_HEADS, DIM, generator=generator)
                    for _ in range(2))  # fmt: skip
    table = None
    if paged:  # 16-position blocks in a shuffled order, the last block scratch
        block = 16
        order = torch.randperm(slots * SEQ // block, generator=generator)
        paged_k = torch.zeros(len(order) + 1, block, KV_HEADS, DIM)
        paged_v = torch.zeros_like(paged_k)
        paged_k[order] = keys.reshape(-1, block, KV_HEADS, DIM)
        paged_v[order] = values.reshape(-1, block, KV_HEADS, DIM)
        table = order.view(slots, -1).to(torch.int32).to(DEVICE)
        keys, values = paged_k, paged_v
    firsts, counts, chunk_slots = [], [], []
    positions = torch.zeros(tokens, dtype=torch.int64)
    offset = 0
    for slot, cached, new in chunks:
        firsts.append(offset)
        counts.append(new)
        chunk_slots.append(slot)
        positions[offset : offset + new] = torch.arange(cached, cached + new)
        offset += new
    per_tile = per_tile or tile_tokens(heads, KV_HEADS)
    tiles = chunk_tiles(firsts, counts, chunk_slots, tokens, per_tile,
                        tile_count(tokens, len(chunks), per_tile))  # fmt: skip
    q = torch.randn(tokens, heads, DIM, generator=generator)
    return (q.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), positions.to(DEVICE),
            torch.from_numpy(tiles).to(DEVICE), table, offset)  # fmt: skip


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("heads", [4, 6])
@pytest.mark.parametrize("per_tile", [None, 5])  # whole chunks a tile; tiles cut at odd places
def test_chunk_attention_equals_the_gathered_reference(paged, heads, per_tile):
    generator = torch.Generator().manual_seed(heads + paged)
    q, keys, values, positions, tiles, table, used = _step(heads, paged, generator, per_tile)
    out = chunk_attention(q, keys, values, positions, tiles, table=table)
    expected = chunk_attention_reference(q, keys, values, positions, tiles, table=table)
    torch.testing.assert_close(out[:used], expected[:used], rtol=1e-5, atol=1e-5)
    assert not out[used:].any()  # padding tokens: zeros


@pytest.mark.parametrize("heads", [4, 6])
def test_chunk_attention_over_an_fp8_cache_reads_the_dequantized_k_v(heads):
    """e4m3 K/V with a scale per (position, kv head) (cache/fp8_kv.py): the kernel equals its
    reference and itself over the dequantized cache in the model's dtype."""
    from hybridflow.engine.cache.fp8_kv import dequantize_heads, quantize_heads

    generator = torch.Generator().manual_seed(heads)
    q, keys, values, positions, tiles, table, used = _step(heads, True, generator, 5)
    # each head's max at 448: e4m3 values read without their scales are far off
    (keys, key_scales), (values, value_scales) = (quantize_heads(x.cpu()) for x in (keys, values))
    keys, key_scales, values, value_scales = (t.to(DEVICE) for t in (keys, key_scales, values,
                                                                      value_scales))  # fmt: skip
    scales = (key_scales, value_scales)
    out = chunk_attention(q, keys, values, positions, tiles, table=table, kv_scales=scales)
    expected = chunk_attention_reference(q, keys, values, positions, tiles, table=table,
                                         kv_scales=scales)  # fmt: skip
    torch.testing.assert_close(out[:used], expected[:used], rtol=1e-5, atol=1e-5)
    plain = chunk_attention(q, dequantize_heads(keys, key_scales, q.dtype),
                            dequantize_heads(values, value_scales, q.dtype), positions, tiles,
                            table=table)  # fmt: skip
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
    assert not out[used:].any()  # padding tokens: zeros


def test_tiles_cover_each_chunk_in_pieces_and_the_padding_after_them():
    tiles = chunk_tiles([0, 5], [5, 3], [2, 4], 12, per_tile=4, num_tiles=tile_count(12, 2, 4))
    used = [tuple(row) for row in tiles.tolist() if row != [-1, 0, 0]]
    assert used == [(2, 0, 4), (2, 4, 5), (4, 5, 8), (-1, 8, 12)]
    with pytest.raises(ValueError, match="tiles needed"):
        chunk_tiles([0], [12], [1], 12, per_tile=1, num_tiles=4)


def test_strided_queries_are_read_in_place():
    """q as a column view of a wider product (the fused qkv matmul's output)."""
    generator = torch.Generator().manual_seed(7)
    q, keys, values, positions, tiles, table, used = _step(4, True, generator)
    wide = torch.randn(q.shape[0], 3 * q.shape[1] * DIM, generator=generator).to(DEVICE)
    wide[:, : q.shape[1] * DIM] = q.reshape(q.shape[0], -1)
    view = wide[:, : q.shape[1] * DIM].view(q.shape[0], q.shape[1], DIM)
    out = chunk_attention(view, keys, values, positions, tiles, table=table)
    expected = chunk_attention(q, keys, values, positions, tiles, table=table)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# -- packed prompts over their own K/V, with sinks and a window (a GPT-OSS prefill) ---------


def _packed(lengths, heads, generator):
    tokens = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(tokens, heads, DIM, generator=generator)
    k, v = (torch.randn(tokens, KV_HEADS, DIM, generator=generator) for _ in range(2))
    sinks = torch.randn(heads, generator=generator) * 3  # some above the scores
    return [t.to(DEVICE) for t in (q, k, v, sinks, cu)]


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("heads", [4, 6])
@pytest.mark.parametrize("per_tile", [None, 5])
def test_packed_prompts_with_sinks_equal_the_models_attention(window, heads, per_tile):
    """Prompts of 23, 1, 40 and 9 tokens packed (longer and shorter than the window of 8),
    tiles of the kernel's size or cut at odd places: the model's packed sink attention."""
    from hybridflow.engine.kernels.chunk_attention import packed_attention, packed_tiles
    from hybridflow.models.mixers.sink_attention import sink_attention_packed

    generator = torch.Generator().manual_seed(heads + window)
    q, k, v, sinks, cu = _packed([23, 1, 40, 9], heads, generator)
    layout = packed_tiles(cu, q.shape[0], per_tile or tile_tokens(heads, KV_HEADS))
    got = packed_attention(q, k, v, layout, sinks, window)
    expected = sink_attention_packed(q, k, v, sinks, window, cu)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    plain = packed_attention(q, k, v, layout, None, window)
    assert (got - plain).abs().max() > 1e-2  # the sinks changed the output
    if window:  # the window masked keys: the full layer's output differs
        assert (got - packed_attention(q, k, v, layout, sinks, 0)).abs().max() > 1e-2


def test_a_window_capped_at_the_longest_prompt_reads_what_full_attention_reads():
    """The engine passes a window past max_seq_len as max_seq_len (layers/sink.py's
    attended_window): prompts of at most 40 tokens under a window of 64 read what the full
    layer (window 0) and the model's 2**31 - 1-token window read."""
    from hybridflow.engine.kernels.chunk_attention import packed_attention, packed_tiles
    from hybridflow.models.mixers.sink_attention import sink_attention_packed

    q, k, v, sinks, cu = _packed([23, 1, 40, 9], 4, torch.Generator().manual_seed(3))
    layout = packed_tiles(cu, q.shape[0], tile_tokens(4, KV_HEADS))
    got = packed_attention(q, k, v, layout, sinks, SEQ)
    torch.testing.assert_close(got, packed_attention(q, k, v, layout, sinks, 0), rtol=0, atol=0)
    expected = sink_attention_packed(q, k, v, sinks, 2**31 - 1, cu)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packed_tiles_cut_each_prompt_and_number_its_tokens():
    from hybridflow.engine.kernels.chunk_attention import packed_tiles

    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    tiles, positions = packed_tiles(cu, 14, per_tile=4)
    used = [tuple(row) for row in tiles.tolist() if row != [-1, 0, 0]]
    assert used == [(0, 0, 4), (0, 4, 5), (5, 5, 6), (6, 6, 10), (6, 10, 14)]
    assert tiles.shape[0] == tile_count(14, 3, 4)
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7]
