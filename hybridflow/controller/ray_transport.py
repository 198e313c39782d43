"""Values between the controller and Ray actors: tensor bytes out of band, copied once.

Ray pickles what crosses between processes with pickle protocol 5: the bytes of a numpy
array go out of band, written once into the object store and handed to the reader as a
zero-copy view of it. A Batch pickles its tensors that way already (``Batch.__reduce__``);
a torch tensor anywhere else is pickled by torch, through a copy into the pickle stream
(7x slower for a dict of 204 MiB of tensors, such as the weights the controller passes
from the actor to the rollout in a split placement). ``encode`` pickles every tensor as a
Batch does, as a flat uint8 numpy view of its own bytes (bfloat16 and bool included), and
keeps those bytes out of the stream, for Ray to move the zero-copy way.

The views Ray hands back are read-only, and all readers of an object on a node share them:
a write through one (torch does not refuse it) would change what the other ranks read.
So ``decode`` gives each buffer a private copy, the one copy a reader pays, in the ordinary
allocator (which reuses the last batch's memory). One arena in fresh huge pages, Arrow IPC,
and leaving the views read-only were measured beside it: docs/performance-host.md
"Controller overhead".
"""

from __future__ import annotations

import copyreg
import functools
import io
import pickle
from collections import ChainMap
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.protocol import raw_to_tensor, tensor_to_raw


@dataclass(frozen=True)
class Encoded:
    """A value as it crosses Ray: the pickle stream without its buffers' bytes, and those
    bytes, one flat uint8 numpy array per tensor or numeric array (out of band for Ray)."""

    payload: bytes
    buffers: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def encode(value: Any) -> Encoded:
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _pickler_class()(stream, protocol=5, buffer_callback=buffers.append).dump(value)
    return Encoded(stream.getvalue(), tuple(np.frombuffer(b.raw(), np.uint8) for b in buffers))


def decode(encoded: Encoded) -> Any:
    """The value, with writable tensors that share memory with nothing the sender or another
    reader holds (always on the CPU)."""
    return pickle.loads(encoded.payload, buffers=[private_copy(b) for b in encoded.buffers])


def private_copy(buffer: np.ndarray) -> np.ndarray:
    """A writable buffer (already private, e.g. after an in-band pickle) as it is, a
    read-only one (a view of Ray's object store) copied."""
    return buffer if buffer.flags.writeable else buffer.copy()


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    return raw_to_tensor, tensor_to_raw(tensor)


@functools.cache
def _pickler_class() -> type:
    """A pickler that reduces tensors to numpy bytes; Ray's cloudpickle when Ray is there, as
    Ray pickles call arguments: functions and classes of a script's ``__main__`` travel by
    value, as they did before."""
    try:
        from ray.cloudpickle import Pickler

        base = Pickler.dispatch_table
    except ImportError:
        Pickler, base = pickle.Pickler, copyreg.dispatch_table
    # By exact type, as a dispatch table goes: Parameter is a subclass of its own.
    tensors = {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor}
    return type("TensorPickler", (Pickler,), {"dispatch_table": ChainMap(tensors, base)})
