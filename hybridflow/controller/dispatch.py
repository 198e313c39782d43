"""How one controller call becomes one call per rank, and how the per-rank results come back.

``@register(dispatch=Dispatch.X)`` marks a worker method as remote-callable and says how:

- ``ONE_TO_ALL``: every rank gets the same arguments; the result is the list of per-rank results.
- ``DP_SPLIT``: every ``Batch`` argument is padded to a multiple of the world size and split
  into equal chunks, one per rank (other arguments go to every rank); Batch results are
  concatenated in rank order and the padding rows are removed. Non-Batch results come
  back as a list.
- ``RANK_ZERO``: every rank runs the call (SPMD code may use collectives inside), only rank
  0's result is returned.
- ``ALL_TO_ALL``: every argument is a list with one entry per rank; results come back as a list.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from hybridflow.protocol import Batch

DISPATCH_ATTR = "__hybridflow_dispatch__"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    DP_SPLIT = "dp_split"
    RANK_ZERO = "rank_zero"
    ALL_TO_ALL = "all_to_all"


def register(fn: Callable | None = None, *, dispatch: Dispatch = Dispatch.ONE_TO_ALL):
    """Mark a worker method as callable from the controller (``@register`` or
    ``@register(dispatch=Dispatch.DP_SPLIT)``). Unregistered methods stay private to the worker."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"dispatch must be a Dispatch member, got {dispatch!r}")

    def mark(method: Callable) -> Callable:
        setattr(method, DISPATCH_ATTR, dispatch)
        return method

    return mark(fn) if fn is not None else mark


def dispatch_of(method: Any) -> Dispatch | None:
    return getattr(method, DISPATCH_ATTR, None)


PerRankArgs = list[tuple[tuple, dict]]


def scatter(mode: Dispatch, world_size: int, args: tuple, kwargs: dict) -> tuple[PerRankArgs, int]:
    """Arguments for each rank, and the number of padding rows DP_SPLIT added."""
    if mode in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO):
        return [(args, kwargs)] * world_size, 0
    if mode is Dispatch.ALL_TO_ALL:
        for name, value in [*enumerate(args), *kwargs.items()]:
            if not isinstance(value, list | tuple) or len(value) != world_size:
                raise ValueError(
                    f"ALL_TO_ALL argument {name!r} must be a list with one entry per rank "
                    f"({world_size}), got {type(value).__name__}"
                    + (f" of length {len(value)}" if isinstance(value, list | tuple) else "")
                )
        return [
            (tuple(a[rank] for a in args), {k: v[rank] for k, v in kwargs.items()})
            for rank in range(world_size)
        ], 0
    return _split_batches(world_size, args, kwargs)


def _split_batches(world_size: int, args: tuple, kwargs: dict) -> tuple[PerRankArgs, int]:
    batches = [v for v in [*args, *kwargs.values()] if isinstance(v, Batch)]
    if not batches:
        raise ValueError("DP_SPLIT needs at least one Batch argument to split")
    lengths = {len(b) for b in batches}
    if len(lengths) > 1:
        raise ValueError(f"DP_SPLIT Batch arguments differ in length: {sorted(lengths)}")
    pad_size = 0

    def chunks(value: Any) -> list[Any]:
        nonlocal pad_size
        if not isinstance(value, Batch):
            return [value] * world_size
        padded, pad_size = value.pad_to_divisor(world_size)
        return padded.chunk(world_size)

    arg_chunks = [chunks(a) for a in args]
    kwarg_chunks = {k: chunks(v) for k, v in kwargs.items()}
    per_rank = [
        (tuple(c[rank] for c in arg_chunks), {k: c[rank] for k, c in kwarg_chunks.items()})
        for rank in range(world_size)
    ]
    return per_rank, pad_size


def gather(mode: Dispatch, results: list[Any], pad_size: int, method: str) -> Any:
    """Combine per-rank results (in rank order) into what the controller sees."""
    if mode is Dispatch.RANK_ZERO:
        return results[0]
    if mode is not Dispatch.DP_SPLIT:
        return results
    if all(r is None for r in results):
        return None
    if not all(isinstance(r, Batch) for r in results):
        return results
    merged = Batch.concat(results)
    if pad_size:
        expected = sum(len(r) for r in results) - len(results[-1]) + len(results[0])
        if len(merged) != expected or len(results[-1]) != len(results[0]):
            raise ValueError(
                f"{method}: DP_SPLIT padded the input with {pad_size} rows but the ranks returned "
                f"{[len(r) for r in results]} rows; a DP_SPLIT method must return one row per "
                "input row so that the padding can be removed"
            )
        merged = merged.unpad(pad_size)
    return merged
