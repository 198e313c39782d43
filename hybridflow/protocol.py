"""`Batch`: the one data structure that flows between the controller and the workers.

A Batch holds three dictionaries that share one leading dimension (the batch size B):

- ``tensors``: named ``torch.Tensor`` s, e.g. ``prompts [B, P]``, ``response_mask [B, R]``;
- ``arrays``: named ``numpy.ndarray`` s for everything that is not a tensor, e.g. ``uid``
  strings or ``ground_truth`` dicts (object arrays are allowed);
- ``meta``: a plain dict that is *not* indexed with the rows (temperature, step, metrics).

Every row operation (``index``, ``chunk``, ``repeat``, ...) applies to ``tensors`` and
``arrays`` together and keeps ``meta`` as is. Operations return new Batches that share
storage with the input where torch/numpy do (slices are views), except ``reorder`` which
works in place.

A rollout batch (``RolloutWorker.generate``) carries, per response token [B, R]:
``responses``, ``response_mask`` (1 on generated tokens), ``rollout_logprobs`` (the
engine's log-prob of the token under the weights that sampled it: the behaviour policy of
the importance weights) and ``token_versions`` (int64, the policy version that sampled the
token, -1 after the end; with partial rollouts one sample may span two versions:
hybridflow/trainer/loop/staleness.py).

Pickling writes each tensor's own bytes once (a slice of a large tensor does not drag the
whole storage along, as ``pickle`` of a plain tensor view does), so a pickled Batch is about
as large as the raw tensor data. Tensors always come back on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Batch"]

Index = slice | int | Sequence[int] | np.ndarray | torch.Tensor


class Batch:
    """Named tensors + named non-tensor arrays + meta, all rows along dim 0.

    >>> b = Batch({"input_ids": torch.zeros(4, 7, dtype=torch.long)}, {"uid": np.array(list("abcd"))})
    >>> len(b), b["input_ids"].shape, b["uid"][0]
    (4, torch.Size([4, 7]), 'a')
    """

    __slots__ = ("tensors", "arrays", "meta")

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        arrays: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.arrays: dict[str, np.ndarray] = {k: _as_array(v) for k, v in (arrays or {}).items()}
        self.meta: dict[str, Any] = dict(meta or {})
        self._check_lengths()

    @classmethod
    def from_dict(cls, data: dict[str, Any], meta: dict[str, Any] | None = None) -> Batch:
        """Sort values into tensors (``torch.Tensor``) and arrays (anything else)."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        arrays = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls(tensors, arrays, meta)

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        for value in self.tensors.values():
            return value.shape[0]
        for value in self.arrays.values():
            return value.shape[0]
        return 0

    @property
    def batch_size(self) -> int:
        return len(self)

    def keys(self) -> list[str]:
        """Tensor keys, then array keys."""
        return [*self.tensors, *self.arrays]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.arrays

    def __getitem__(self, key: str | Index) -> Any:
        """``batch["name"]`` returns that tensor/array; anything else indexes rows."""
        if isinstance(key, str):
            if key in self.tensors:
                return self.tensors[key]
            if key in self.arrays:
                return self.arrays[key]
            raise KeyError(f"{key!r} is not in this Batch; keys: {self.keys()}")
        return self.index(key)

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace one column; its leading dimension must match the Batch."""
        if key in self.tensors or key in self.arrays:
            self.tensors.pop(key, None)
            self.arrays.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.arrays[key] = _as_array(value)
        self._check_lengths()

    def __repr__(self) -> str:
        cols = [
            f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
            for k, v in self.tensors.items()
        ]
        cols += [f"{k}: {tuple(v.shape)} np.{v.dtype}" for k, v in self.arrays.items()]
        meta = f", meta keys={sorted(self.meta)}" if self.meta else ""
        return f"Batch(len={len(self)}, " + ", ".join(cols) + meta + ")"

    # ------------------------------------------------------------------ columns
    def select(self, *keys: str, meta: bool = True) -> Batch:
        """A Batch with only ``keys`` (same storage); ``meta`` is kept unless ``meta=False``."""
        self._require(keys)
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.arrays.items() if k in keys},
            self.meta if meta else None,
        )

    def pop(self, *keys: str) -> Batch:
        """Remove ``keys`` from this Batch and return them as a new Batch (meta is shared)."""
        self._require(keys)
        out = self.select(*keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.arrays.pop(k, None)
        return out

    def union(self, other: Batch) -> Batch:
        """Merge columns and meta of two Batches of the same length.

        A key present in both is accepted only when both values are equal; a conflicting
        value raises ``ValueError`` rather than silently picking one.
        """
        if len(self) != len(other) and self.keys() and other.keys():
            raise ValueError(f"union of Batches of different lengths: {len(self)} vs {len(other)}")
        tensors, arrays, meta = dict(self.tensors), dict(self.arrays), dict(self.meta)
        for k, v in other.tensors.items():
            if k in arrays or (k in tensors and not _same_tensor(tensors[k], v)):
                raise ValueError(f"union: key {k!r} exists in both Batches with different values")
            tensors[k] = v
        for k, v in other.arrays.items():
            if k in tensors or (k in arrays and not _same_array(arrays[k], v)):
                raise ValueError(f"union: key {k!r} exists in both Batches with different values")
            arrays[k] = v
        for k, v in other.meta.items():
            if k in meta and not _same_meta(meta[k], v):
                raise ValueError(f"union: meta key {k!r} differs: {meta[k]!r} vs {v!r}")
            meta[k] = v
        return Batch(tensors, arrays, meta)

    # ------------------------------------------------------------------ rows
    def index(self, idx: Index) -> Batch:
        """Rows ``idx`` (slice, int, list/array/tensor of ints, or boolean mask) as a new Batch.

        An int keeps the first dimension: ``batch.index(3)`` has length 1.
        """
        if isinstance(idx, int | np.integer):
            idx = slice(int(idx), int(idx) + 1) if idx != -1 else slice(-1, None)
        if isinstance(idx, slice):
            return self._map_rows(lambda v: v[idx], lambda a: a[idx])
        if isinstance(idx, torch.Tensor):
            idx_np = idx.detach().cpu().numpy()
        else:
            idx_np = np.asarray(idx)
            if idx_np.size == 0:
                idx_np = idx_np.astype(np.int64)
        if idx_np.dtype != np.bool_ and not np.issubdtype(idx_np.dtype, np.integer):
            raise TypeError(f"Batch index must hold ints or bools, got dtype {idx_np.dtype}")
        idx_t = torch.from_numpy(np.ascontiguousarray(idx_np))
        return self._map_rows(lambda v: v[idx_t.to(v.device)], lambda a: a[idx_np])

    def reorder(self, idx: Index) -> None:
        """In place: rows become ``self[idx]`` (e.g. a permutation that balances lengths)."""
        reordered = self.index(idx)
        self.tensors, self.arrays = reordered.tensors, reordered.arrays

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of ``size`` rows; the last one may be shorter."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.index(slice(start, start + size)) for start in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """``n`` equal pieces. The length must be divisible by ``n``: see ``pad_to_divisor``."""
        if n <= 0:
            raise ValueError(f"chunk count must be positive, got {n}")
        if len(self) % n:
            raise ValueError(
                f"cannot chunk a Batch of {len(self)} rows into {n} equal pieces; "
                f"use batch.pad_to_divisor({n}) first and unpad the result"
            )
        return self.split(len(self) // n) if len(self) else [self.index(slice(0, 0))] * n

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all ``batches`` in order; all must have the same keys. Meta of the first."""
        if not batches:
            raise ValueError("concat needs at least one Batch")
        first = batches[0]
        for b in batches[1:]:
            if b.tensors.keys() != first.tensors.keys() or b.arrays.keys() != first.arrays.keys():
                raise ValueError(f"concat: keys differ: {first.keys()} vs {b.keys()}")
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        arrays = {k: np.concatenate([b.arrays[k] for b in batches]) for k in first.arrays}
        return Batch(tensors, arrays, first.meta)

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Append rows (copies of the first rows, so they are valid data) until ``divisor``
        divides the length. Returns ``(padded, pad_size)``; undo with ``unpad(pad_size)``."""
        if divisor <= 0:
            raise ValueError(f"divisor must be positive, got {divisor}")
        n = len(self)
        pad_size = (-n) % divisor
        if pad_size == 0:
            return self, 0
        if n == 0:
            raise ValueError("cannot pad an empty Batch: there is no row to repeat")
        filler = np.arange(pad_size) % n
        return Batch.concat([self, self.index(filler)]), pad_size

    def unpad(self, pad_size: int) -> Batch:
        """Drop the last ``pad_size`` rows added by ``pad_to_divisor``."""
        if pad_size < 0 or pad_size > len(self):
            raise ValueError(f"pad_size {pad_size} out of range for a Batch of {len(self)} rows")
        return self if pad_size == 0 else self.index(slice(0, len(self) - pad_size))

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: ``a a b b`` when ``interleave`` (the ``n`` samples of one prompt
        stay adjacent), else ``a b a b``."""
        if n <= 0:
            raise ValueError(f"repeat count must be positive, got {n}")
        rows = np.arange(len(self))
        order = np.repeat(rows, n) if interleave else np.tile(rows, n)
        return self.index(order)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A Batch whose tensors live on ``device`` (arrays and meta are shared)."""
        return Batch(
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()},
            self.arrays,
            self.meta,
        )

    # ------------------------------------------------------------------ pickling
    def __reduce__(self):
        # Write each tensor as a flat uint8 numpy view of exactly its own bytes: pickle then
        # copies that buffer once (protocol 5 keeps it out of the opcode stream), and a view
        # into a larger storage costs only its own size. bfloat16 has no numpy dtype, hence
        # the raw bytes plus the torch dtype.
        packed = {k: tensor_to_raw(v) for k, v in self.tensors.items()}
        return (_rebuild_batch, (packed, self.arrays, self.meta))

    # ------------------------------------------------------------------ helpers
    def _map_rows(self, on_tensor, on_array) -> Batch:
        return Batch(
            {k: on_tensor(v) for k, v in self.tensors.items()},
            {k: on_array(v) for k, v in self.arrays.items()},
            self.meta,
        )

    def _require(self, keys: Iterable[str]) -> None:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"keys {missing} are not in this Batch; keys: {self.keys()}")

    def _check_lengths(self) -> None:
        lengths = {}
        for k, v in [*self.tensors.items(), *self.arrays.items()]:
            if not isinstance(v, torch.Tensor | np.ndarray):
                raise TypeError(f"Batch column {k!r} must be a tensor or array, got {type(v)}")
            if v.ndim == 0:
                raise ValueError(f"Batch column {k!r} is a scalar; put scalars in meta")
            lengths[k] = v.shape[0]
        if len(set(lengths.values())) > 1:
            raise ValueError(f"Batch columns differ in their leading dimension: {lengths}")


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        raise TypeError("put tensors in Batch.tensors, not Batch.arrays")
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, list | tuple):
        if value and _all_numbers(value):
            return np.asarray(value)
        # One object per row, even when rows are equal-length lists (which np.asarray
        # would turn into a 2-D array) or strings of different widths.
        out = np.empty(len(value), dtype=object)
        for i, item in enumerate(value):
            out[i] = item
        return out
    return np.asarray(value)


def _all_numbers(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float | bool | np.number) for v in values)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    if a is b:
        return True
    if a.shape != b.shape:
        return False
    try:
        return bool(np.all(a == b))
    except (ValueError, TypeError):
        return all(_same_meta(x, y) for x, y in zip(a.tolist(), b.tolist()))


def _same_meta(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and _same_array(a, b)
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        return False


def tensor_to_raw(tensor: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], np.ndarray]:
    """(dtype, shape, its own bytes as a flat uint8 numpy view): what a Batch pickles per
    tensor; ``raw_to_tensor`` rebuilds it."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy()


def raw_to_tensor(dtype: torch.dtype, shape: tuple[int, ...], raw: np.ndarray) -> torch.Tensor:
    if raw.size == 0:  # numpy may give an empty array stride 0, which .view(dtype) refuses
        return torch.empty(shape, dtype=dtype)
    if not raw.flags.writeable:
        # Zero-copy unpickling (Ray's object store) hands out read-only buffers; workers
        # write into batches in place, so take a private copy.
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _rebuild_batch(packed: dict, arrays: dict, meta: dict) -> Batch:
    return Batch({k: raw_to_tensor(*v) for k, v in packed.items()}, arrays, meta)
