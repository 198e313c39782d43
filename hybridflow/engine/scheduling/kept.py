"""Kept KV: cache slots that outlive the request that filled them, so the next turn of a
conversation prefills only its new tokens.

A request generated with `keep=True` leaves its slot holding the K/V of its prompt and of
every generated token but the last (the last sampled token has not been through the model
yet). The engine hands back a handle; a later request that names it in `reuse` and whose
prompt starts with exactly those tokens is admitted into the same slot and prefilled from
there. Anything else (another prefix, an evicted or released handle, weights loaded since)
is prefilled in full: continuing is an optimisation, never a change of what is sampled.

Kept slots are taken from the engine's slots: when a call needs more free slots than are
left, the oldest kept ones are evicted first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict


class KeptKV:
    """handle -> (slot, the token ids whose K/V the slot holds), oldest first."""

    def __init__(self):
        self._entries: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()
        self._handles = itertools.count(1)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def handles(self) -> list[int]:
        return list(self._entries)

    def slots(self) -> set[int]:
        return {slot for slot, _ in self._entries.values()}

    def keep(self, slot: int, cached_ids: list[int]) -> int:
        handle = next(self._handles)
        self._entries[handle] = (slot, cached_ids)
        return handle

    def take(self, handle: int | None, prompt: list[int]) -> tuple[int, int] | None:
        """(slot, cached length) if `handle` is kept and its tokens are a proper prefix of
        `prompt` (the entry leaves the store: the caller now owns the slot); else None and,
        for a mismatched handle, the entry stays (release or eviction frees it)."""
        if handle is None or handle not in self._entries:
            return None
        slot, cached = self._entries[handle]
        if len(cached) >= len(prompt) or prompt[: len(cached)] != cached:
            return None
        del self._entries[handle]
        return slot, len(cached)

    def release(self, handles) -> list[int]:
        """Forget these handles (unknown ones are ignored); returns their slots."""
        return [self._entries.pop(h)[0] for h in list(handles) if h in self._entries]

    def evict_oldest(self) -> int:
        """The slot of the oldest kept entry, forgotten (the store must not be empty)."""
        _, (slot, _) = self._entries.popitem(last=False)
        self.evictions += 1
        return slot

    def clear(self) -> None:
        """Every handle invalid (the cache was freed or the weights changed)."""
        self._entries.clear()
