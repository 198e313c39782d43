"""Values between the controller and Ray actors: tensor bytes out of band, copied once.

Ray pickles what crosses between processes with pickle protocol 5: the bytes of a numpy
array go out of band, written once into the object store and handed to the reader as a
zero-copy view of it; a torch tensor, pickled by torch, is copied into the pickle stream
instead. ``encode`` takes every tensor out of a value (those of Batches too, anywhere in it;
each distinct tensor once) as a flat uint8 numpy view of its own bytes (bfloat16 and bool
included), so that Ray moves all of them the zero-copy way.

The views Ray hands back are read-only, and all readers of an object on a node share them:
a write through one (torch does not refuse it) would change what the other ranks read. So
``decode`` gives each tensor a private copy of its bytes: the one copy a reader pays. It
stays per tensor, in the ordinary allocator, which reuses the memory of the last batch;
one arena in fresh huge pages, Arrow IPC, and leaving the views read-only were measured
beside it (docs/performance-host.md "Controller overhead").
"""

from __future__ import annotations

import functools
import io
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.controller.transport import TensorUnpickler, raw_bytes, take_tensor


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
    in-band pickle) as they are, read-only ones copied."""
    return [_private_tensor(b) for b in buffers]


def _private_tensor(buffer: np.ndarray) -> torch.Tensor:
    if buffer.nbytes == 0:  # numpy gives empty arrays stride 0, which .view(dtype) refuses
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(buffer if buffer.flags.writeable else buffer.copy())


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
