"""Messages between processes on one node, with tensor bytes in shared memory.

``encode(obj)`` pickles ``obj`` but takes every tensor (including those inside Batches,
anywhere in the message) out of the pickle stream. When they add up to at least
``SHM_MIN_BYTES`` they are written once into one file in ``/dev/shm``, and the receiver builds
its tensors as zero-copy views of a private (copy-on-write) mapping of that file.

Two kinds of file. A fresh one per message (``encode``, and ``encode_many`` without a pool):
the receiver unlinks it as it maps it (the mapping stays valid, and nothing leaks if it dies
later). Or one of a ``SegmentPool``'s (segment_pool.py), which the local backend uses for
every call and reply: what makes it fast is that nothing is allocated per call. A fresh file
makes the kernel allocate and zero each 4 KiB page, the receivers fault each one into their
mapping and the last one free them all (about 300 ms at 200 MiB on a 2-core host, 10 times the
memcpy); a pool's segment stays allocated and mapped by the sender and every receiver, so a
call costs one memcpy into it, and a segment is written again only once every view of its last
message has been freed in every receiver (a view kept longer keeps its bytes).

Small messages, or machines without ``/dev/shm``, carry the tensor bytes inline.
Tensors always arrive on the CPU.
"""

from __future__ import annotations

import glob
import io
import mmap
import os
import pickle
import uuid
from typing import Any

import torch

from hybridflow.controller.segment_pool import SegmentPool, SegmentReader
from hybridflow.protocol import Batch

SHM_DIR = "/dev/shm"
# Below this many tensor bytes a message goes inline (creating a file costs ~50 us).
SHM_MIN_BYTES = 1 << 20
SHM_PREFIX = "hybridflow-"
_ALIGN = 64


def shm_min_bytes() -> int:
    """SHM_MIN_BYTES, or HYBRIDFLOW_SHM_MIN_BYTES for benchmarks that compare both paths. Read
    at each message, not at import: a forked worker imports this module before it takes on
    its controller's environment (controller/fork_server.py)."""
    return int(os.environ.get("HYBRIDFLOW_SHM_MIN_BYTES", SHM_MIN_BYTES))


def segment_prefix(owner: str) -> str:
    """File name prefix for segments written by ``owner`` (used to clean up after crashes)."""
    return f"{SHM_PREFIX}{owner}-"


class _TensorPickler(pickle.Pickler):
    def __init__(
        self, file: io.BytesIO, tensors: list[torch.Tensor], slots: dict[int, int]
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors, self.slots = tensors, slots  # shared by all messages of one encode_many

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in self.slots:  # the same tensor sent to several ranks: stored once
                self.slots[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return ("tensor", self.slots[id(obj)], obj.dtype, tuple(obj.shape))
        if type(obj) is Batch:
            # The nested tensors come back through persistent_id as well.
            return ("batch", obj.tensors, obj.arrays, obj.meta)
        return None


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "tensor":
            _, index, dtype, shape = pid
            return self.tensors[index].view(dtype).reshape(shape)
        _, tensors, arrays, meta = pid
        return Batch(tensors, arrays, meta)


def encode(obj: Any, owner: str) -> bytes:
    """Serialise ``obj``; ``owner`` names the shared-memory segment (see ``segment_prefix``).
    The receiver unlinks the segment when it maps it."""
    messages, _ = encode_many([obj], owner, receiver_unlinks=True)
    return messages[0]


def encode_many(
    objs: list[Any], owner: str, receiver_unlinks: bool = False, pool: SegmentPool | None = None
) -> tuple[list[bytes], str | None]:
    """One message per object (e.g. per rank), all tensors in one segment, each distinct
    tensor written once. With ``pool`` the segment is one the pool reuses (message ``i``
    must go to the same receiver at every call, and be decoded with a ``SegmentReader``).
    Otherwise it is a fresh file. Unless ``receiver_unlinks``, the caller unlinks the
    returned path (a fresh file, or a pool's new one) once every receiver has decoded its
    message."""
    tensors: list[torch.Tensor] = []
    slots: dict[int, int] = {}
    payloads = []
    for obj in objs:
        buffer = io.BytesIO()
        _TensorPickler(buffer, tensors, slots).dump(obj)
        payloads.append(buffer.getvalue())
    raw = [
        t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors
    ]  # [nbytes]
    sizes = [r.numel() for r in raw]
    offsets, total = _layout(sizes)
    segment = pooled = None
    if total >= shm_min_bytes() and os.path.isdir(SHM_DIR):
        if pool is not None:
            pooled = pool.write(raw, offsets, total, len(objs))
        if pooled is None:
            segment = _write_segment(raw, offsets, total, owner)
    carriers: list[Any]
    if pooled is not None:
        name, generation, new = pooled
        unlink = new and receiver_unlinks
        carriers = [
            ("pool", name, generation, index, offsets, total, unlink) for index in range(len(objs))
        ]
        if new and not receiver_unlinks:
            segment = os.path.join(SHM_DIR, name)
    elif segment is not None:
        carriers = [("shm", segment, offsets, total, receiver_unlinks)] * len(objs)
    else:
        carriers = [("inline", [r.numpy().tobytes() for r in raw])] * len(objs)
    messages = [pickle.dumps((c, sizes, p), protocol=5) for c, p in zip(carriers, payloads)]
    return messages, None if receiver_unlinks else segment


def decode(data: bytes, reader: SegmentReader | None = None) -> Any:
    """``reader``: needed for messages written through a ``SegmentPool``."""
    carrier, sizes, payload = pickle.loads(data)
    if carrier[0] == "pool":
        if reader is None:
            raise ValueError("a message from a SegmentPool is decoded with a SegmentReader")
        _, name, generation, index, offsets, total, unlink = carrier
        base = reader.view(name, generation, index, total, unlink)
        tensors = [base[o : o + n] for o, n in zip(offsets, sizes)]
    elif carrier[0] == "shm":
        _, path, offsets, total, unlink = carrier
        base = _map_segment(path, total, unlink)
        tensors = [base[o : o + n] for o, n in zip(offsets, sizes)]
    else:
        tensors = [
            torch.frombuffer(bytearray(b), dtype=torch.uint8)
            if b
            else torch.empty(0, dtype=torch.uint8)
            for b in carrier[1]
        ]
    return _TensorUnpickler(io.BytesIO(payload), tensors).load()


def segment_pool(owner: str) -> SegmentPool:
    """The reused segments of ``owner`` (see ``segment_prefix``), for ``encode_many``."""
    return SegmentPool(SHM_DIR, segment_prefix(owner))


def segment_reader() -> SegmentReader:
    return SegmentReader(SHM_DIR)


def release_unsent(message: bytes, pool: SegmentPool) -> None:
    """A message of ``encode_many(..., pool=pool)`` that will not be sent: its receiver's
    share of the segment is free again."""
    carrier = pickle.loads(message)[0]
    if carrier[0] == "pool":
        pool.release_unsent(*carrier[1:4])


def remove_segments(owner: str) -> None:
    """Unlink segments ``owner`` wrote that no receiver mapped (the receiver died first)."""
    for path in glob.glob(os.path.join(SHM_DIR, segment_prefix(owner) + "*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for n in sizes:
        offsets.append(cursor)
        cursor += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, cursor


def _write_segment(
    raw: list[torch.Tensor], offsets: list[int], total: int, owner: str
) -> str | None:
    path = os.path.join(SHM_DIR, segment_prefix(owner) + uuid.uuid4().hex[:16])
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Sized up front (sparse), filled with pwrite: a full /dev/shm then fails here with
        # ENOSPC (and we fall back to inline bytes) instead of a SIGBUS through a mapping.
        os.ftruncate(fd, total)
        for data, offset in zip(raw, offsets):
            view = memoryview(data.numpy())
            while len(view):
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None  # e.g. /dev/shm full: fall back to inline bytes
    os.close(fd)
    return path


def _map_segment(path: str, total: int, unlink: bool) -> torch.Tensor:
    fd = os.open(path, os.O_RDONLY)
    try:
        # Private (copy-on-write): a worker that edits its tensors in place neither changes
        # what another rank mapped from the same segment nor needs a copy to read.
        mapping = mmap.mmap(
            fd, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)
        if unlink:
            os.unlink(path)
    # The tensor keeps the mapping alive; it is unmapped when the last view is freed.
    return torch.frombuffer(mapping, dtype=torch.uint8)
