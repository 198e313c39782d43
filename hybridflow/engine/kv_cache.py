"""Slot-based preallocated KV cache and its sizing from a memory budget.

One slot holds one sequence (prompt + generated tokens) up to max_seq_len: `keys`/`values`
are [layers, slots + 1, max_seq_len, kv_heads, head_dim], token-major inside a slot (a
prefill writes each prompt as one block; a decode attention program, one row and one kv head,
reads its head's D elements at a stride of kv_heads * D). Kernels index through the strides.

The extra last slot is a scratch slot: padded rows of a bucketed decode batch write there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    keys: torch.Tensor  # [L, slots + 1, S, kv_heads, head_dim]
    values: torch.Tensor  # [L, slots + 1, S, kv_heads, head_dim]

    @property
    def num_slots(self) -> int:
        """Usable slots (the scratch slot excluded)."""
        return self.keys.shape[1] - 1

    @property
    def scratch_slot(self) -> int:
        return self.keys.shape[1] - 1

    @property
    def max_seq_len(self) -> int:
        return self.keys.shape[2]

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def copy_positions(
        self, src_slots: torch.Tensor, dst_slots: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """cache[:, dst_slots[i], positions[i]] = cache[:, src_slots[i], positions[i]] for
        every layer, K and V, in one gather/scatter each (fans a prefilled prompt out to its n
        sample slots; flat index lists built on the host, so no device sync)."""
        for cache in (self.keys, self.values):
            cache[:, dst_slots, positions] = cache[:, src_slots, positions]


def bytes_per_slot(
    num_layers: int, kv_heads: int, head_dim: int, max_seq_len: int, dtype: torch.dtype
) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * max_seq_len * kv_heads * head_dim * element


def available_bytes(device: torch.device) -> int:
    """Device memory this process can allocate: free on the device plus what PyTorch's
    allocator holds cached but unused (a colocated trainer's freed activations and gradients
    stay reserved; counting free memory alone shrank the rollout's cache after the first
    training step)."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(0, cached)


def plan_slots(
    max_batch_size: int,
    slot_bytes: int,
    memory_budget: int | float | None,
    device: torch.device,
    reserve_bytes: int = 0,
) -> int:
    """Number of slots: max_batch_size, or fewer if the budget does not hold them.

    memory_budget: bytes (int > 1), a fraction of the available device memory (float in
    (0, 1]; available_bytes), or None (90% of it minus reserve_bytes on CUDA; unlimited on
    CPU)."""
    if memory_budget is None:
        if device.type != "cuda":
            return max_batch_size
        budget = int(0.9 * available_bytes(device)) - reserve_bytes
    elif isinstance(memory_budget, float) and 0 < memory_budget <= 1:
        if device.type == "cuda":
            budget = int(memory_budget * available_bytes(device)) - reserve_bytes
        else:
            return max_batch_size
    else:
        budget = int(memory_budget)
    slots = min(max_batch_size, budget // slot_bytes - 1)  # -1: the scratch slot
    if slots < 1:
        raise ValueError(
            f"memory_budget={memory_budget} holds no KV-cache slot of {slot_bytes / 2**20:.1f} MiB "
            "(max_seq_len tokens): raise memory_budget or lower max_seq_len"
        )
    return slots


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
