"""Values between the controller and Ray actors: tensor bytes out of band, copied once.

Ray pickles what crosses between processes with pickle protocol 5: the bytes of a numpy
array go out of band, written once into the object store and handed to the reader as a
zero-copy view of it; a torch tensor, pickled by torch, is copied into the pickle stream
instead. ``encode`` takes every tensor out of a value (those of Batches too, anywhere in it;
each distinct tensor once) as a flat uint8 numpy view of its own bytes (bfloat16 and bool
included), so that Ray moves all of them the zero-copy way.

The views Ray hands back are read-only, and all readers of an object on a node share them:
a write through one (torch does not refuse it) would change what the other ranks read. So
``decode`` copies the read-only buffers once into one private, writable mapping with
transparent huge pages advised, which spares the page faults of fresh memory: the copy of a
204 MiB batch took 19 ms there against 101 ms in 4 KiB pages on a 2-core host (numbers in
docs/performance-host.md "Controller overhead"). Arrow IPC was measured too: it writes one
more copy on the sender for the same read-only views at the reader.
"""

from __future__ import annotations

import functools
import io
import mmap
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.controller.transport import TensorUnpickler, layout, raw_bytes, take_tensor

HUGE_PAGE = 2 << 20  # below this a copy goes to the ordinary allocator


@dataclass(frozen=True)
class Encoded:
    """A value as it crosses Ray: the pickle stream without the tensors' bytes, and those
    bytes, one flat uint8 array per distinct tensor (pickled out of band by Ray)."""

    payload: bytes
    buffers: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def encode(value: Any) -> Encoded:
    tensors: list[torch.Tensor] = []
    stream = io.BytesIO()
    _tensor_pickler()(stream, tensors).dump(value)
    return Encoded(stream.getvalue(), tuple(raw_bytes(t).numpy() for t in tensors))


def decode(encoded: Encoded) -> Any:
    """The value, with writable tensors that share memory with nothing the sender or another
    reader holds (always on the CPU)."""
    tensors = private_tensors(list(encoded.buffers))
    return TensorUnpickler(io.BytesIO(encoded.payload), tensors).load()


def private_tensors(buffers: list[np.ndarray]) -> list[torch.Tensor]:
    """One flat uint8 tensor per buffer: writable buffers (already private, e.g. after an
    in-band pickle) as they are, read-only ones copied into one private arena."""
    readonly = [i for i, b in enumerate(buffers) if not b.flags.writeable]
    offsets, total = layout([buffers[i].nbytes for i in readonly])
    arena = _private_arena(total)
    arena_np = arena.numpy()
    tensors = [torch.from_numpy(b) if b.flags.writeable else None for b in buffers]
    for index, offset in zip(readonly, offsets):
        size = buffers[index].nbytes
        np.copyto(arena_np[offset : offset + size], buffers[index])
        tensors[index] = arena[offset : offset + size]
    return tensors


def _private_arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of writable memory [nbytes] uint8; large ones in an anonymous private
    mapping with huge pages advised (freed when the last tensor viewing it is)."""
    if nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere ordinary pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


@functools.cache
def _tensor_pickler() -> type:
    """A pickler that takes tensors out (``take_tensor``), built on Ray's cloudpickle when Ray
    is there, as Ray pickles call arguments: functions and classes of a script's
    ``__main__`` then travel by value, as they did before."""
    try:
        from ray.cloudpickle import Pickler
    except ImportError:
        Pickler = pickle.Pickler

    class TensorPickler(Pickler):
        def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self.tensors: list[torch.Tensor] = tensors
            self.slots: dict[int, int] = {}

        def persistent_id(self, obj: Any) -> Any:
            return take_tensor(obj, self.tensors, self.slots)

    return TensorPickler
