"""The preallocated KV cache, slot-based or paged, and its sizing from a memory budget.

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
    allocate_scales,
    dequantize_heads,
    fp8_kv_bytes_per_position,
    quantize_heads,
)
from hybridflow.engine.cache.kinds import (
    RecurrentStates,
    RecurrentStateSpec,
    kv_layer_rows,
    recurrent_state_spec,
)
from hybridflow.engine.cache.latent import LatentSpec, latent_spec
from hybridflow.engine.cache.window import WindowedKV, WindowSpec, window_spec


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


def bytes_per_slot(
    num_layers: int, kv_heads: int, head_dim: int, max_seq_len: int, dtype: torch.dtype,
    route_bytes: int = 0,
) -> int:  # fmt: skip
    """route_bytes: the routing record's bytes per position (RouteSpec.bytes_per_position)."""
    element = torch.empty((), dtype=dtype).element_size()
    return (2 * num_layers * kv_heads * head_dim * element + route_bytes) * max_seq_len


def bytes_per_block(
    num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    route_bytes: int = 0,
) -> int:  # fmt: skip
    return bytes_per_slot(num_layers, kv_heads, head_dim, block_size, dtype, route_bytes)


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


def available_bytes(device: torch.device) -> int:
    """Device memory this process can allocate: free on the device plus what PyTorch's
    allocator holds cached but unused (a colocated trainer's freed activations and gradients
    stay reserved; counting free memory alone shrank the rollout's cache after the first
    training step)."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(0, cached)


def cache_budget(
    memory_budget: int | float | None, device: torch.device, reserve_bytes: int = 0
) -> int | None:
    """Bytes the cache may take: memory_budget as bytes (int > 1), a fraction of the
    available device memory (float in (0, 1]; available_bytes), or None (90% of it); minus
    reserve_bytes when taken from the device. None: unlimited (a fraction or None on CPU)."""
    if memory_budget is not None and not 0 < memory_budget <= 1:
        return int(memory_budget)
    if device.type != "cuda":
        return None
    fraction = 0.9 if memory_budget is None else float(memory_budget)
    return int(fraction * available_bytes(device)) - reserve_bytes


def _reserve_taken(memory_budget: int | float | None) -> bool:
    """Whether cache_budget takes the reserve out of this budget: a fraction of the device's
    memory (or None), not bytes given outright."""
    return memory_budget is None or 0 < memory_budget <= 1


def plan_slots(
    max_batch_size: int,
    slot_bytes: int,
    memory_budget: int | float | None,
    device: torch.device,
    reserve_bytes: int = 0,
) -> int:
    """Number of slots of a slot cache: max_batch_size, or fewer if the budget
    (cache_budget) does not hold them."""
    budget = cache_budget(memory_budget, device, reserve_bytes)
    if budget is None:
        return max_batch_size
    slots = min(max_batch_size, budget // slot_bytes - 1)  # -1: the scratch slot
    if slots < 1:
        raise ValueError(
            f"memory_budget={memory_budget} holds no KV-cache slot of {slot_bytes / 2**20:.1f} MiB "
            "(max_seq_len tokens): raise memory_budget or lower max_seq_len"
        )
    return slots


def plan_blocks(
    max_batch_size: int,
    max_seq_len: int,
    block_size: int,
    block_bytes: int,
    memory_budget: int | float | None,
    device: torch.device,
    reserve_bytes: int = 0,
) -> int:
    """Blocks of a paged cache: what the budget holds, at most enough for max_batch_size
    sequences of max_seq_len (no sequence can use more), at least one sequence's worth."""
    per_sequence = -(-max_seq_len // block_size)
    most = max_batch_size * per_sequence
    budget = cache_budget(memory_budget, device, reserve_bytes)
    blocks = most if budget is None else min(most, budget // block_bytes - 1)
    if blocks < per_sequence:
        raise ValueError(
            f"memory_budget={memory_budget} holds {max(blocks, 0)} KV blocks of {block_size} "
            f"positions; one sequence of max_seq_len={max_seq_len} needs {per_sequence}: raise "
            "memory_budget or lower max_seq_len"
        )
    return blocks


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


def make_cache(
    config,
    max_batch_size: int,
    max_seq_len: int,
    block_size: int | None,
    memory_budget: int | float | None,
    reserve_bytes: int,
    dtype: torch.dtype,
    device: torch.device,
    routes: RouteSpec | None = None,
    cap_state_slots: bool = True,
    row_reserve_bytes: int = 0,
    kv_fp8: bool = False,
) -> tuple[KVCache, object]:
    """The KV cache a model config's engine gets from its budget: a slot cache (block_size
    None) or a paged one, with the paged one's host-side blocks.BlockPool (else None).
    routes: the routing record to keep beside K and V (route_spec), counted in the budget.
    K/V for the layers whose spec keeps them, the latent for MLA layers (latent.latent_spec:
    its bytes a position counted instead of K/V's); the recurrent layers' per-sequence state
    (kinds.recurrent_state_spec) and the sliding layers' rings (window.window_spec) for every
    slot, taken from the budget first. Beside a paged cache, a bounded budget gets at most
    the slots whose states and blocks hold that many whole max_seq_len sequences
    (state_slots; cap_state_slots False: every one of max_batch_size). ``row_reserve_bytes``:
    the part of reserve_bytes each of max_batch_size rows takes (its sampling), given back to
    the cache for the rows capped slots never decode. kv_fp8: K/V in e4m3 with their scales
    (fp8_kv.py; ValueError where fp8_kv_problem names a gap)."""
    specs = config.layer_specs()
    if kv_fp8:
        from hybridflow.engine.cache.fp8_kv import fp8_kv_problem

        problem = fp8_kv_problem(specs, paged=block_size is not None)
        if problem is not None:
            raise ValueError(problem)
    rows = kv_layer_rows(specs)
    layers = sum(row is not None for row in rows)
    states = _PerSequence(recurrent_state_spec(config, dtype), window_spec(config, dtype))
    latent = latent_spec(config, dtype)
    shape = (config.num_key_value_heads, config.head_dim)
    # what a position keeps beside K/V: its routing record, MLA layers' latent
    route_bytes = routes.bytes_per_position if routes is not None else 0
    route_bytes += latent.bytes_per_position if latent is not None else 0
    if block_size is None:
        slot_bytes = bytes_per_slot(layers, *shape, max_seq_len, dtype, route_bytes)
        slot_bytes += states.bytes_per_sequence
        slots = plan_slots(max_batch_size, slot_bytes, memory_budget, device, reserve_bytes)
        cache = allocate_cache(layers, slots, max_seq_len, *shape, dtype, device)
        if routes is not None:
            cache.routes = routes.allocate(slots + 1, max_seq_len, device)
        _with_latent(cache, latent, len(rows), slots + 1, max_seq_len, device)
        return _with_kinds(cache, rows, states, slots, device), None
    from hybridflow.engine.cache.blocks import BlockPool

    stored = torch.float8_e4m3fn if kv_fp8 else dtype
    block_bytes = bytes_per_block(layers, *shape, block_size, dtype, route_bytes)
    if kv_fp8:  # e4m3 K/V and their scales
        block_bytes = (fp8_kv_bytes_per_position(layers, *shape) + route_bytes) * block_size
    slots = max_batch_size
    if states.bytes_per_sequence:  # a state per slot whatever the blocks: off the budget first
        budget = cache_budget(memory_budget, device, reserve_bytes)
        if budget is not None:
            per_sequence = -(-max_seq_len // block_size)
            # a budget given in bytes is the cache's own: no reserve was taken out of it
            row = row_reserve_bytes if _reserve_taken(memory_budget) else 0
            slots = state_slots(max_batch_size, budget, states.bytes_per_sequence, block_bytes,
                                per_sequence, cap_state_slots, row)  # fmt: skip
            if cap_state_slots:
                _check_whole_sequence(budget, max_seq_len, states, block_bytes, per_sequence)
            budget += (max_batch_size - slots) * row  # the rows never decoded
            memory_budget, reserve_bytes = budget - (slots + 1) * states.bytes_per_sequence, 0
            _check_state_budget(memory_budget, slots, states)
    blocks = plan_blocks(slots, max_seq_len, block_size, block_bytes, memory_budget, device,
                         reserve_bytes)  # fmt: skip
    cache = allocate_paged_cache(layers, slots, blocks, block_size, max_seq_len, *shape,
                                 stored, device)  # fmt: skip
    if kv_fp8:
        cache.scales = allocate_scales(cache.keys.shape, dtype, device)
    if routes is not None:
        cache.routes = routes.allocate(blocks + 1, block_size, device)
    _with_latent(cache, latent, len(rows), blocks + 1, block_size, device)
    cache = _with_kinds(cache, rows, states, slots, device)
    return cache, BlockPool(blocks, block_size, slots, cache.block_table.shape[1])


@dataclass(frozen=True)
class _PerSequence:
    """The per-sequence kinds of a cache (either may be None), sized together."""

    recurrent: RecurrentStateSpec | None
    window: WindowSpec | None

    @property
    def bytes_per_sequence(self) -> int:
        return sum(kind.bytes_per_sequence for kind in (self.recurrent, self.window) if kind)


def whole_sequence_slots(budget: int, state_bytes: int, block_bytes: int,
                         blocks_per_sequence: int) -> int:  # fmt: skip
    """The most slots S whose per-sequence kinds ((S + 1) of them, the scratch slot's too)
    and the K/V blocks of S whole sequences (S x blocks_per_sequence, and the scratch block)
    fit ``budget`` bytes; >= 0. Beside a paged cache every slot's state is allocated up
    front, so slots beyond S leave fewer whole sequences held at once."""
    sequence = state_bytes + blocks_per_sequence * block_bytes
    return max((budget - state_bytes - block_bytes) // sequence, 0)


def state_slots(max_batch_size: int, budget: int | None, state_bytes: int, block_bytes: int,
                blocks_per_sequence: int, cap: bool = True, row_bytes: int = 0) -> int:  # fmt: skip
    """Slots of a paged cache with per-sequence kinds of ``state_bytes`` a slot: at most
    max_batch_size, capped (``cap``) at whole_sequence_slots where the budget (bytes; None:
    unbounded) does not hold max_batch_size whole sequences, at least one (the blocks'
    sizing then names what a sequence needs). The engine (make_cache) and the memory plan
    (trainer/plan/memory_rollout.py) both size the slots here.

    ``row_bytes``: the workspace each decoded row reserves outside the cache (its sampling:
    workspace.sampling_bytes_per_row), already taken out of ``budget`` for max_batch_size
    rows. Capped slots decode fewer rows, so the rows they drop give their workspace back to
    the cache: a slot then costs its state, its blocks and its row."""
    if budget is None or not cap or not state_bytes:
        return max_batch_size
    whole = whole_sequence_slots(budget + max_batch_size * row_bytes, state_bytes + row_bytes,
                                 block_bytes, blocks_per_sequence)  # fmt: skip
    return max(min(max_batch_size, whole), 1)


def _check_state_budget(left: int, slots: int, states: _PerSequence) -> None:
    if left <= 1:  # an int budget of 1 or less would read as a fraction of free memory
        raise ValueError(
            f"memory_budget holds no KV blocks once the recurrent state or sliding-window ring "
            f"of max_batch_size="
            f"{slots} sequences ({states.bytes_per_sequence / 2**20:.2f} MiB each) is "
            "taken: raise memory_budget or lower max_batch_size"
        )


def _check_whole_sequence(budget: int, max_seq_len: int, states: _PerSequence,
                          block_bytes: int, per_sequence: int) -> None:  # fmt: skip
    """Refuse a budget that holds not one sequence of max_seq_len beside its state (and the
    scratch slot's state and block), naming both sizes."""
    sequence_bytes = block_bytes * per_sequence
    if not whole_sequence_slots(budget, states.bytes_per_sequence, block_bytes, per_sequence):
        raise ValueError(
            f"memory_budget holds no whole sequence of max_seq_len={max_seq_len} beside its "
            f"recurrent state or sliding-window ring ({states.bytes_per_sequence / 2**20:.2f} "
            f"MiB a slot, the scratch slot's too) and its K/V blocks "
            f"({sequence_bytes / 2**20:.2f} MiB): raise memory_budget or lower max_seq_len"
        )


def _with_latent(cache: KVCache, latent: LatentSpec | None, num_layers: int, entries: int,
                 positions: int, device: torch.device) -> None:  # fmt: skip
    """The MLA layers' latent beside K/V (entries: slots or blocks, scratch included)."""
    if latent is not None:
        cache.latent = latent.allocate(entries, positions, device)
        cache.latent_rows = latent.rows(num_layers)


def _with_kinds(cache: KVCache, rows, states: _PerSequence, slots: int,
                device: torch.device) -> KVCache:  # fmt: skip
    """The cache with its layer rows and the per-sequence kinds of its slots."""
    if any(row != layer for layer, row in enumerate(rows)):
        cache.kv_rows = rows
    if states.recurrent is not None:
        cache.states = states.recurrent.allocate(slots, device)
    if states.window is not None:
        cache.window = states.window.allocate(slots, device)
    return cache
