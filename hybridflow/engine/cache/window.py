"""The windowed K/V cache kind: what a sliding-window attention layer (GPT-OSS's) keeps.

A query at position p of such a layer sees keys p - window + 1 .. p only, so a sequence
keeps its last ``window`` positions of K/V there, in a ring of ``window`` entries per
sequence: position p at entry p % window. Its size is fixed whatever the length, so it is a
per-sequence kind (kinds.py), one ring per slot beside the full layers' blocks, like the
recurrent state: copied to a prompt's other samples after its prefill, rebuilt by the
prefill of a preempted request, counted per slot in the cache budget. The full layers keep
every position in the slot cache or the blocks (kv_cache.py).

A ring holds ``ring_length`` entries: the window, at most the engine's max_seq_len. A
sequence never reaches that many positions, so a window at least as long attends over its
whole prefix (full attention), which a ring of max_seq_len holds without wrapping: a
checkpoint's 128k (or 2**31 - 1) window costs a 4k context's K/V, not the window's.

Attention is a sum over keys, so the ring's order does not matter: a row at position p
(stored) reads entries j <= p of its ring, each holding position
``p - ((p - j) mod window)`` (``ring_positions``), every one of them inside the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engine.cache.arithmetic import ring_length


@dataclass(frozen=True)
class WindowSpec:
    """The rings of the sliding layers ``layers`` (model indices), ``window`` positions of
    [kv_heads, head_dim] K and V each, in ``dtype``: the ring's length (ring_length), not
    the layers' window where that exceeds max_seq_len."""

    layers: tuple[int, ...]
    window: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_sequence(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.window * self.kv_heads * self.head_dim * element

    def allocate(self, slots: int, device: torch.device) -> WindowedKV:
        """Zeroed rings for `slots` sequences and a scratch slot (padding rows, finished rows
        and warm-up steps write there). Zeros: a masked entry must not carry NaN into a
        matmul."""
        shape = (len(self.layers), slots + 1, self.window, self.kv_heads, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=device)
        rows = {layer: i for i, layer in enumerate(self.layers)}
        return WindowedKV(keys, torch.zeros_like(keys), rows)


def window_spec(config, dtype: torch.dtype, max_seq_len: int) -> WindowSpec | None:
    """The rings a model config's sliding layers need for sequences of at most max_seq_len
    tokens (None: no sliding layer)."""
    specs = config.layer_specs()
    layers = tuple(i for i, spec in enumerate(specs) if spec.keeps_kv and spec.window)
    if not layers:
        return None
    windows = {specs[i].window for i in layers}
    if len(windows) > 1:  # engine_gaps names it; no family has two sizes
        raise ValueError(f"sliding windows of several sizes {sorted(windows)}: one expected")
    length = ring_length(windows.pop(), max_seq_len)
    return WindowSpec(layers, length, config.num_key_value_heads, config.head_dim, dtype)


@dataclass
class WindowedKV:
    """keys/values [L_win, slots + 1, window, kv_heads, head_dim]; ``rows`` maps a model layer
    to its L_win index."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: dict[int, int]

    @property
    def window(self) -> int:
        return self.keys.shape[2]

    @property
    def scratch_slot(self) -> int:
        return self.keys.shape[1] - 1

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [slots + 1, window, kv_heads, head_dim] of model layer `index`."""
        row = self.rows[index]
        return self.keys[row], self.values[row]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Sequence dst[i] takes sequence src[i]'s rings in every layer (device index lists)."""
        self.keys[:, dst] = self.keys[:, src]
        self.values[:, dst] = self.values[:, src]

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


def ring_positions(last: torch.Tensor, window: int) -> torch.Tensor:
    """last [T]: the last position each sequence has stored (-1: none) -> [T, window], the
    position entry j of its ring holds (negative: never written)."""
    entries = torch.arange(window, device=last.device)
    return last[:, None] - torch.remainder(last[:, None] - entries[None, :], window)


def store_last_positions(
    ring: tuple[torch.Tensor, torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    ends: torch.Tensor,
    scratch: int,
) -> None:
    """Store the tokens' k/v [N, kv_heads, D] (of slots/positions [N]) in their rings, those
    within a window of their sequence's last position ends [N] only: an earlier one would
    share an entry with a later one (one index_put cannot order them). The others go to the
    scratch slot, so nothing syncs with the host."""
    keys, values = ring
    window = keys.shape[1]
    kept = positions > ends - window
    targets = torch.where(kept, slots, torch.full_like(slots, scratch))
    entries = torch.remainder(positions, window)
    keys[targets, entries] = k.to(keys.dtype)
    values[targets, entries] = v.to(values.dtype)
