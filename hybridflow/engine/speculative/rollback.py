"""Rejected drafts rolled back in per-sequence cache kinds (cache/kinds.py): a Gated DeltaNet
layer's recurrent state (conv and SSM) and a sliding layer's ring of K/V. A verify pass moves
them through every draft it feeds, and neither can be cut back by length as K/V can
(verify.py). So the kinds of each row with drafts are copied before the pass, and after it,
for each row that did not keep all of its inputs, copied back and moved again through the
inputs it kept (its last token and the drafts emitted before its last emitted token) by an
extend pass of those alone. That pass recomputes the kept positions' K/V too, to the same
values; its logits are not read.

Cost: a copy of the rows' states a pass (for a large hybrid model tens of MB a row), and a
second, shorter forward whenever some row rejected a draft.
"""

from __future__ import annotations

import torch


def sequence_tensors(cache) -> list[torch.Tensor]:
    """The tensors of a cache's per-sequence kinds, each indexed [layer, slot, ...]."""
    tensors = []
    if cache.states is not None:
        tensors += [cache.states.conv, cache.states.ssm]
    if getattr(cache, "window", None) is not None:
        tensors += [cache.window.keys, cache.window.values]
    return tensors


def save(cache, slots: list[int]) -> list[torch.Tensor] | None:
    """Copies of these slots' per-sequence kinds (None when the cache has none or no slot
    is given)."""
    tensors = sequence_tensors(cache)
    if not tensors or not slots:
        return None
    index = torch.as_tensor(slots, device=tensors[0].device)
    return [tensor[:, index].clone() for tensor in tensors]


def restore(cache, slots: list[int], saved: list[torch.Tensor], which: list[int]) -> None:
    """Slots[i] for i in `which` take back their saved kinds (saved: save(cache, slots))."""
    tensors = sequence_tensors(cache)
    device = tensors[0].device
    index = torch.as_tensor([slots[i] for i in which], device=device)
    picked = torch.as_tensor(which, device=device)
    for tensor, copy in zip(tensors, saved):
        tensor[:, index] = copy[:, picked]


def kept_inputs(drafts: list[list[int]], emitted: list[int]) -> list[int]:
    """For each row, how many of the pass's inputs (its last token, then its drafts) its
    state must have seen: one per emitted token (the last emitted one is the next input)."""
    return [min(count, len(draft) + 1) for draft, count in zip(drafts, emitted)]


def rows_to_redo(drafts: list[list[int]], emitted: list[int], saved_rows: list[int]) -> list[int]:
    """The rows (among those saved) whose state saw inputs they did not keep."""
    kept = kept_inputs(drafts, emitted)
    return [r for r in saved_rows if kept[r] < len(drafts[r]) + 1]
