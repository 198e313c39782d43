"""The KV cache sized from a memory budget: the bytes a slot or a block takes, the slots or
blocks a budget holds (beside the per-sequence states of recurrent and sliding-window layers),
and :func:`make_cache`, which allocates what the budget holds (kv_cache.py: the cache itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engine.cache.arithmetic import (
    fp8_kv_bytes_per_position,
    state_slots,
    whole_sequence_slots,
)
from hybridflow.engine.cache.fp8_kv import allocate_scales
from hybridflow.engine.cache.kinds import (
    RecurrentStateSpec,
    kv_layer_rows,
    recurrent_state_spec,
)
from hybridflow.engine.cache.kv_cache import (
    KVCache,
    RouteSpec,
    allocate_cache,
    allocate_paged_cache,
)
from hybridflow.engine.cache.latent import LatentSpec, latent_spec
from hybridflow.engine.cache.window import WindowSpec, window_spec


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
    (kinds.recurrent_state_spec) and the sliding layers' rings (window.window_spec: at most
    max_seq_len positions each) for every slot, taken from the budget first. Beside a paged cache, a bounded budget gets at most
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
    rings = window_spec(config, dtype, max_seq_len)
    states = _PerSequence(recurrent_state_spec(config, dtype), rings)
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
