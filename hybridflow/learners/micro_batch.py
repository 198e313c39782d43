"""How samples are cut into micro-batches and spread over data-parallel ranks.

Pure functions on lists of sequence lengths; they return index lists and never touch tensors,
so the learners and the controller can both use them and they are easy to test.

- :func:`split_fixed`: micro-batches of a fixed number of samples.
- :func:`pack_by_token_budget`: micro-batches of at most ``max_tokens`` tokens (packed
  sequences, so a micro-batch costs what its real tokens cost, not ``B × T_max``).
- :func:`karmarkar_karp`: partition lengths into ``k`` sets of nearly equal sums (largest
  differencing method, Karmarkar & Karp 1982), optionally with equal set sizes.
- :func:`balanced_dp_order`: reorder a batch so that contiguous DP chunks carry nearly equal
  token counts (every rank then waits the same time in each collective).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def split_fixed(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``micro_batch_size`` indices (the last one may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [
        list(range(start, min(start + micro_batch_size, num_samples)))
        for start in range(0, num_samples, micro_batch_size)
    ]


class _PartialPartition:
    """One state of the differencing method: k sets, each a (sum, items) pair."""

    __slots__ = ("sums", "items")

    def __init__(self, sums: list[int], items: list[list[int]]):
        self.sums = sums
        self.items = items

    @property
    def spread(self) -> int:
        return max(self.sums) - min(self.sums)

    def merge(self, other: _PartialPartition) -> _PartialPartition:
        """Join the heaviest sets of one state with the lightest of the other (differencing)."""
        mine = sorted(range(len(self.sums)), key=lambda i: self.sums[i], reverse=True)
        theirs = sorted(range(len(other.sums)), key=lambda i: other.sums[i])
        sums = [self.sums[a] + other.sums[b] for a, b in zip(mine, theirs)]
        items = [self.items[a] + other.items[b] for a, b in zip(mine, theirs)]
        return _PartialPartition(sums, items)


def karmarkar_karp(lengths: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Partition ``range(len(lengths))`` into ``k`` lists whose length sums are nearly equal.

    With ``equal_size`` every list gets ``len(lengths) / k`` items (needs divisibility): items
    are taken in sorted order ``k`` at a time and each group seeds one state with one item per
    set, so merging keeps the counts equal. Each returned list is sorted; the lists are ordered
    by decreasing sum. Deterministic: ties are broken by index.
    """
    n = len(lengths)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal_size partition of {n} items into {k} sets needs n % k == 0")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    states: list[_PartialPartition] = []
    if equal_size:
        for start in range(0, n, k):
            group = order[start : start + k]
            states.append(_PartialPartition([lengths[i] for i in group], [[i] for i in group]))
    else:
        for i in order:
            states.append(_PartialPartition([lengths[i]] + [0] * (k - 1), [[i]] + [[]] * (k - 1)))
    if not states:
        return [[] for _ in range(k)]
    # Max-heap on spread; the counter keeps the order deterministic among equal spreads.
    heap = [(-s.spread, tie, s) for tie, s in enumerate(states)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = first.merge(second)
        heapq.heappush(heap, (-merged.spread, tie, merged))
        tie += 1
    final = heap[0][2]
    sets = [sorted(items) for items in final.items]
    sums = [sum(lengths[i] for i in items) for items in sets]
    ranked = sorted(range(k), key=lambda j: (-sums[j], sets[j][0] if sets[j] else n))
    return [sets[j] for j in ranked]


def min_micro_batches(lengths: Sequence[int], max_tokens: int) -> int:
    """Fewest micro-batches :func:`pack_by_token_budget` needs for these lengths (>= 1)."""
    return len(pack_by_token_budget(lengths, max_tokens))


def pack_by_token_budget(
    lengths: Sequence[int], max_tokens: int, *, num_micro_batches: int | None = None
) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens`` tokens each.

    Without ``num_micro_batches``: the fewest groups found, starting from the lower bound
    ``ceil(sum / max_tokens)`` and balancing token counts across them (Karmarkar–Karp), so the
    micro-batches cost about the same. With ``num_micro_batches`` (all ranks must run the same
    number of forward/backward passes under FSDP, so the learner passes the max over ranks):
    exactly that many groups, some possibly empty when there are fewer samples than groups.
    Raises ``ValueError`` if one sample alone exceeds the budget.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        index, length = too_long[0]
        raise ValueError(
            f"sample {index} has {length} tokens, more than the token budget max_tokens_per_gpu = "
            f"{max_tokens}: raise the budget to at least the longest sequence"
        )
    n = len(lengths)
    if n == 0:
        return [[] for _ in range(num_micro_batches or 1)]
    k = max(1, math.ceil(sum(lengths) / max_tokens))
    while True:
        groups = karmarkar_karp(lengths, min(k, n))
        if all(sum(lengths[i] for i in g) <= max_tokens for g in groups):
            break
        k += 1
    if num_micro_batches is None or num_micro_batches == len(groups):
        return groups
    if num_micro_batches < len(groups):
        raise ValueError(
            f"{num_micro_batches} micro-batches cannot hold these {n} samples under "
            f"{max_tokens} tokens; at least {len(groups)} are needed"
        )
    # More groups than needed: a balanced partition into exactly that many usually still fits;
    # if the heuristic overshoots, split the largest feasible groups instead (always fits).
    if num_micro_batches <= n:
        wider = karmarkar_karp(lengths, num_micro_batches)
        if all(sum(lengths[i] for i in g) <= max_tokens for g in wider):
            return wider
    while len(groups) < num_micro_batches:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            groups.append([])
            continue
        largest = max(splittable, key=lambda g: sum(lengths[i] for i in g))
        groups.remove(largest)
        groups.extend(karmarkar_karp([lengths[i] for i in largest], 2))
        groups[-2:] = [[largest[j] for j in part] for part in groups[-2:]]
    return groups


def balanced_dp_order(lengths: Sequence[int], dp_size: int) -> list[int]:
    """A permutation of the samples such that chunk ``r`` of the reordered batch (contiguous,
    ``len / dp_size`` samples each, as a DP split cuts it) holds about ``1/dp_size`` of the
    tokens. Needs ``len(lengths) % dp_size == 0``. Within a chunk, original order is kept."""
    if dp_size <= 1:
        return list(range(len(lengths)))
    parts = karmarkar_karp(lengths, dp_size, equal_size=True)
    parts.sort(key=lambda p: p[0] if p else len(lengths))  # stable, readable rank assignment
    return [i for part in parts for i in part]
