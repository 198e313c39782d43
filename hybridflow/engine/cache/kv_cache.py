"""The preallocated KV cache, slot-based or paged (its sizing from a memory budget: sizing.py).

A slot is one sequence (prompt + generated tokens, up to max_seq_len): what the scheduler
admits into and decode rows point at. Where its K/V live:

- slot cache (block_table None): `keys`/`values` are [layers, slots + 1, max_seq_len,
  kv_heads, head_dim], each slot reserving max_seq_len positions;
- paged (block_table [slots + 1, max_seq_len / block_size] int32): [layers, blocks + 1,
  block_size, kv_heads, head_dim], position p of a slot in block block_table[slot, p //
  block_size] at p % block_size. Blocks are handed out as sequences grow (blocks.py), and
  the full blocks of a prompt are shared by its n samples.

Token-major inside a slot or block (a decode attention program, one row and one kv head, reads
its head's D elements at a stride of kv_heads * D); kernels index through the strides. The
extra last slot (and block) is scratch: padded rows of a bucketed decode batch write there.

A mixture-of-experts model's cache also holds the routing record (`routes`, routing replay):
each position's expert ids per sparse layer, [slots + 1, S, L_sparse, k] or [blocks + 1, B,
L_sparse, k] (uint8 up to 256 experts, else int16), laid out like K and V so that it is
shared, fanned out and grown with them; the scheduler reads a request's rows when it ends.

K and V are kept for the layers whose spec keeps them only (``kv_rows``: a model layer's row
of the layer axis); a hybrid model's recurrent layers keep a per-sequence state instead
(``states``, kinds.RecurrentStates, one row per slot), sized in the same budget; so do the
sliding-window layers, a ring of a window's K/V per slot (``window``, window.WindowedKV).
MLA layers keep their latent per position (``latent``, cache/latent.py: [L_latent, entries,
positions, kv_lora_rank + rope], laid out like K and V so that it is shared, fanned out and
grown with them; ``latent_rows``: a model layer's row of its layer axis).

An FP8 cache (``scales``, fp8_kv.py) keeps K/V as e4m3 with a scale per position and kv head:
``store`` writes through it and ``layer`` reads a layer back in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engine.cache.fp8_kv import (
    KVScales,
    dequantize_heads,
    quantize_heads,
)
from hybridflow.engine.cache.kinds import (
    RecurrentStates,
)
from hybridflow.engine.cache.window import WindowedKV


@dataclass
class KVCache:
    keys: torch.Tensor  # [L, slots + 1, S, kv_heads, head_dim] or [L, blocks + 1, B, ...]
    values: torch.Tensor  # the same shape
    block_table: torch.Tensor | None = None  # paged: int32 [slots + 1, S / B]
    seq_len: int | None = None  # paged: max_seq_len
    routes: torch.Tensor | None = None  # [slots + 1, S, L_sparse, k] or [blocks + 1, B, ...]
    states: RecurrentStates | None = None  # per-sequence state of the recurrent layers
    kv_rows: list[int | None] | None = None  # model layer -> K/V layer row (None: identity)
    window: WindowedKV | None = None  # per-sequence rings of the sliding-window layers
    latent: torch.Tensor | None = None  # [L_latent, slots + 1, S, width] or [.., blocks + 1, B, ..]
    latent_rows: list[int | None] | None = None  # model layer -> latent layer row
    scales: KVScales | None = None  # an FP8 cache's (fp8_kv.py): K/V are e4m3

    @property
    def per_sequence(self) -> bool:
        """The cache holds per-sequence kinds (a recurrent state, a window's ring): a slot's
        are copied to a prompt's samples, and a row whose slot must not change (finished,
        padding, warming up) writes them to the scratch slot."""
        return self.states is not None or self.window is not None

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def num_slots(self) -> int:
        """Usable slots (the scratch slot excluded)."""
        rows = self.block_table.shape[0] if self.paged else self.keys.shape[1]
        return rows - 1

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def num_blocks(self) -> int:
        """Usable blocks of a paged cache (the scratch block, the last, excluded)."""
        return self.keys.shape[1] - 1

    @property
    def block_size(self) -> int:
        """Positions per block (a slot cache's one block per slot: max_seq_len)."""
        return self.keys.shape[2]

    @property
    def max_seq_len(self) -> int:
        return self.seq_len if self.paged else self.keys.shape[2]

    def nbytes(self) -> int:
        routes = 0 if self.routes is None else self.routes.numel() * self.routes.element_size()
        states = 0 if self.states is None else self.states.nbytes()
        states += 0 if self.window is None else self.window.nbytes()
        latent = 0 if self.latent is None else self.latent.numel() * self.latent.element_size()
        scales = 0 if self.scales is None else self.scales.nbytes()
        return self.keys.numel() * self.keys.element_size() * 2 + routes + states + latent + scales

    def store(self, row: int, entries: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:  # fmt: skip
        """K/V row ``row`` at (entries, offsets) = k, v [N, kv_heads, D] (quantized in an FP8
        cache)."""
        if self.scales is None:
            self.keys[row, entries, offsets] = k
            self.values[row, entries, offsets] = v
            return
        for cache, scales, x in ((self.keys, self.scales.keys, k),
                                 (self.values, self.scales.values, v)):  # fmt: skip
            values, scale = quantize_heads(x)
            cache[row, entries, offsets] = values
            scales[row, entries, offsets] = scale

    def layer(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of K/V row ``row`` in the model dtype (an FP8 cache's dequantized:
        a copy, for the eager passes)."""
        if self.scales is None:
            return self.keys[row], self.values[row]
        dtype = self.scales.dtype
        return (dequantize_heads(self.keys[row], self.scales.keys[row], dtype),
                dequantize_heads(self.values[row], self.scales.values[row], dtype))  # fmt: skip

    def layer_scales(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8 cache's (key scales, value scales) of K/V row ``row`` (the Triton kernels
        read them beside the e4m3 values); None for a model-dtype cache."""
        if self.scales is None:
            return None
        return self.scales.keys[row], self.scales.values[row]

    def kv_row(self, layer: int) -> int:
        """Model layer `layer`'s row of keys/values (a hybrid model keeps K/V in some layers)."""
        return layer if self.kv_rows is None else self.kv_rows[layer]

    def latent_row(self, layer: int) -> int:
        """Model layer `layer`'s row of the latent (an MLA layer's)."""
        return self.latent_rows[layer]

    def copy_sequences(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot dst[i] takes slot src[i]'s per-sequence kinds (a recurrent state), device index
        lists; the per-position kinds move with copy_entries and shared blocks."""
        if self.states is not None and src.numel():
            self.states.copy(src, dst)
        if self.window is not None and src.numel():
            self.window.copy(src, dst)

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple:
        """(entries, offsets) of positions of slots, as the cache's dim 1 and 2 index them
        (on the device, no sync: decode rows whose positions only the device knows)."""
        if not self.paged:
            return slots, positions
        blocks = self.block_table[slots, positions // self.block_size].long()
        return blocks, positions % self.block_size

    def gather(self, layer_cache: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Positions [0, length) of each slot from one layer's cache -> [B, length, kv, D]."""
        if not self.paged:
            return layer_cache[slots, :length]
        blocks = -(-length // self.block_size)
        entries = layer_cache[self.block_table[slots, :blocks].long()]  # [B, blocks, B, kv, D]
        return entries.flatten(1, 2)[:, :length]

    def copy_entries(self, src: tuple, dst: tuple) -> None:
        """cache[:, dst rows[i], dst cols[i]] = cache[:, src rows[i], src cols[i]] for every
        layer, K and V, one gather/scatter each (fans a prefilled prompt out to its samples:
        every position in a slot cache, a paged cache's last partial block; flat index lists
        built on the host, so no device sync)."""
        kinds = [self.keys, self.values]
        kinds += [] if self.scales is None else [self.scales.keys, self.scales.values]
        for cache in kinds:
            cache[:, dst[0], dst[1]] = cache[:, src[0], src[1]]
        if self.latent is not None:
            self.latent[:, dst[0], dst[1]] = self.latent[:, src[0], src[1]]
        if self.routes is not None:
            self.routes[dst[0], dst[1]] = self.routes[src[0], src[1]]

    def read_routes(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Positions [0, length) of each slot's routing record -> [B, length, L_sparse, k]."""
        if not self.paged:
            return self.routes[slots, :length]
        blocks = -(-length // self.block_size)
        entries = self.routes[self.block_table[slots, :blocks].long()]  # [B, blocks, B, L, k]
        return entries.flatten(1, 2)[:, :length]


@dataclass(frozen=True)
class RouteSpec:
    """The routing record of a mixture-of-experts model: k expert ids per sparse layer and
    position, uint8 up to 256 experts (int16 above)."""

    sparse_layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.num_experts <= 256 else torch.int16

    @property
    def bytes_per_position(self) -> int:
        return self.sparse_layers * self.top_k * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, entries: int, positions: int, device: torch.device) -> torch.Tensor:
        shape = (entries, positions, self.sparse_layers, self.top_k)
        return torch.zeros(shape, dtype=self.dtype, device=device)


def route_spec(config) -> RouteSpec | None:
    """The routing record a model config needs (None: a dense model)."""
    sparse = config.sparse_layer_indices() if getattr(config, "num_experts", 0) else []
    if not sparse:
        return None
    return RouteSpec(len(sparse), config.num_experts_per_tok, config.num_experts)


def allocate_cache(
    num_layers: int,
    slots: int,
    max_seq_len: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """Zeroed K and V caches [L, slots + 1, S, kv_heads, D]. Zeros, not empty: stale NaNs in
    never-written positions must not reach a masked softmax through 0 * NaN in a matmul."""
    shape = (num_layers, slots + 1, max_seq_len, kv_heads, head_dim)
    return KVCache(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))  # fmt: skip


def allocate_paged_cache(
    num_layers: int,
    slots: int,
    blocks: int,
    block_size: int,
    max_seq_len: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """Zeroed paged K and V [L, blocks + 1, block_size, kv_heads, D] (zeros: as above) and a
    block table whose every entry is the scratch block (blocks.py hands out the others)."""
    shape = (num_layers, blocks + 1, block_size, kv_heads, head_dim)
    per_sequence = -(-max_seq_len // block_size)
    table = torch.full((slots + 1, per_sequence), blocks, dtype=torch.int32, device=device)
    return KVCache(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), table, max_seq_len)  # fmt: skip
