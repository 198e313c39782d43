"""Shared-memory segments that a sender reuses from call to call (transport.py's fast path).

A fresh ``/dev/shm`` file per message makes the kernel allocate and zero every 4 KiB page, each
receiver fault every page into its mapping, and the last one free them all again: about 10 times
the cost of the memcpy itself at 200 MiB. A :class:`SegmentPool` keeps its segments (and its
own mapping of them); a :class:`SegmentReader` keeps each segment mapped once, so that after the
first call a message costs the sender one memcpy into pages every receiver has mapped already.

Lifetime, exactly:
- A segment holds one message set (one ``write``) at a time. Its first page holds one cell per
  receiver; receiver ``i`` (message ``i`` of every write, the same process each time) stores the
  write's generation there when the last tensor viewing its message is freed (a weakref
  finalizer on the buffer every view shares). The sender writes into a segment again only
  when every receiver of its last write has done so: a view kept after later calls (a Batch a
  worker stores) keeps reading its own bytes, and the sender takes another segment meanwhile.
- Receivers map the data privately (copy-on-write), so a receiver that edits its tensors in
  place changes neither the segment nor another rank's view. Before it releases, a receiver
  drops the pages it copied that way (found in /proc/self/pagemap), so that its mapping shows
  the sender's next write.
- Names: a new segment's file is unlinked as a fresh segment's is (by its only receiver when
  it maps it, else by the sender once every receiver has answered); from then on the memory
  goes with the last process that maps it. Until then the file carries the owner's prefix and
  ``transport.remove_segments`` removes it.
- The sender keeps the segments in use plus one spare; it retires the other free ones (and
  those too small for a write): it unmaps them, and receivers unmap them at their next
  message once none of its views is alive.
- A process forked by a receiver inherits its mapping but not its release: it must not keep
  views that its parent has released.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

HEADER = mmap.PAGESIZE  # the cells, then the data (page-aligned, for madvise)
_RETIRED = 0  # cell 0: set by the sender; cell 1 + i: the generation receiver i released
MAX_RECEIVERS = HEADER // 8 - 1
_GRANULE = 2 << 20  # capacities are rounded up to this, so that similar sizes reuse a segment


@dataclass
class _Segment:
    name: str
    capacity: int
    receivers: int
    cells: np.ndarray  # int64 [1 + MAX_RECEIVERS], a shared mapping of the first page
    data: np.ndarray  # uint8 [capacity], a shared mapping of the rest
    generation: int = 0
    linked: bool = True

    def free(self) -> bool:
        return bool((self.cells[1 : 1 + self.receivers] == self.generation).all())


class SegmentPool:
    """The sender's side: ``write`` copies tensor bytes into a free segment."""

    def __init__(self, directory: str, prefix: str) -> None:
        self.directory, self.prefix = directory, prefix
        self.segments: list[_Segment] = []

    def write(
        self, raw: list[torch.Tensor], offsets: list[int], total: int, receivers: int
    ) -> tuple[str, int, bool] | None:
        """Copy ``raw[i]`` to ``offsets[i]`` of a segment whose every receiver released its
        last message; returns (name, generation, new), or None when /dev/shm is full. The
        caller unlinks a ``new`` segment's file once every receiver has mapped it."""
        if not 0 < receivers <= MAX_RECEIVERS:
            return None
        segment = self._take(total, receivers)
        if segment is None:
            return None
        for data, offset in zip(raw, offsets):
            # numpy's single-threaded memcpy: torch's copy_ splits it over its thread pool,
            # up to 8 times slower on a busy host (benchmarks/shared_memory_steps.py).
            np.copyto(segment.data[offset : offset + data.numel()], data.numpy())
        segment.generation += 1
        new, segment.linked = segment.linked, False
        return segment.name, segment.generation, new

    def release_unsent(self, name: str, generation: int, index: int) -> None:
        """Message ``index`` of that write never reached its receiver (e.g. a dead rank):
        release it on the receiver's behalf."""
        for segment in self.segments:
            if segment.name == name and segment.generation == generation:
                segment.cells[1 + index] = generation

    def _take(self, total: int, receivers: int) -> _Segment | None:
        free = [s for s in self.segments if s.receivers == receivers and s.free()]  # oldest first
        fitting = [s for s in free if s.capacity >= total]
        if fitting:
            chosen = min(fitting, key=lambda s: s.capacity)
            spares = sorted((s for s in free if s is not chosen), key=lambda s: s.capacity)
            for segment in spares[:-1]:  # one spare is kept, the largest: memory is bounded
                self._retire(segment)
            return chosen
        for segment in free:  # all too small: retired, and a bigger one made
            self._retire(segment)
        capacity = max(_GRANULE, -(-total // _GRANULE) * _GRANULE)
        segment = self._create(capacity, receivers)
        if segment is not None:
            self.segments.append(segment)
        return segment

    def _create(self, capacity: int, receivers: int) -> _Segment | None:
        name = self.prefix + uuid.uuid4().hex[:16]
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Allocated now: a full /dev/shm fails here (the caller falls back to other means)
            # instead of with a SIGBUS on a later write through the mapping.
            os.posix_fallocate(fd, 0, HEADER + capacity)
            header = mmap.mmap(fd, HEADER, flags=mmap.MAP_SHARED)
            data = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, offset=HEADER)
        except OSError:
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        cells = np.frombuffer(header, dtype=np.int64)
        return _Segment(name, capacity, receivers, cells, np.frombuffer(data, dtype=np.uint8))

    def _retire(self, segment: _Segment) -> None:
        segment.cells[_RETIRED] = 1
        if segment.linked:  # made, never written
            os.unlink(os.path.join(self.directory, segment.name))
        self.segments.remove(segment)  # our mappings go with the last reference

    def close(self) -> None:
        for segment in list(self.segments):
            self._retire(segment)


@dataclass
class _Mapped:
    cells: np.ndarray  # int64, shared: the receiver writes its release cell here
    data: mmap.mmap  # private (copy-on-write)
    array: np.ndarray  # uint8 view of ``data``
    live: int = 0
    # reentrant: a finalizer may run on this thread while it holds the lock
    lock: threading.RLock = field(default_factory=threading.RLock)


class SegmentReader:
    """The receiver's side: each segment mapped once, messages as zero-copy views."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.mapped: dict[str, _Mapped] = {}
        self.lock = threading.Lock()  # the controller reads its workers' replies in threads

    def view(
        self, name: str, generation: int, index: int, total: int, unlink: bool
    ) -> torch.Tensor:
        """uint8 [total]: message ``index`` of ``generation`` in segment ``name``; ``unlink``
        its file once mapped (the only receiver of a new segment)."""
        with self.lock:
            for other in [n for n, m in self.mapped.items() if m.cells[_RETIRED] and not m.live]:
                del self.mapped[other]  # unmapped once its last view is gone (none is left)
            mapped = self.mapped.get(name)
            if mapped is None:
                mapped = self.mapped[name] = self._map(name)
                if unlink:
                    os.unlink(os.path.join(self.directory, name))
            with mapped.lock:
                mapped.live += 1
        region = mapped.array[:total]  # one buffer object for every view of this message
        release = weakref.finalize(region, _release, mapped, 1 + index, generation, total)
        release.atexit = False  # a process that exits releases nothing: its mappings go with it
        return torch.from_numpy(region)

    def _map(self, name: str) -> _Mapped:
        fd = os.open(os.path.join(self.directory, name), os.O_RDWR)
        try:
            header = mmap.mmap(fd, HEADER, flags=mmap.MAP_SHARED)
            size = os.fstat(fd).st_size - HEADER
            data = mmap.mmap(
                fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=HEADER,
            )  # fmt: skip
        finally:
            os.close(fd)
        return _Mapped(np.frombuffer(header, dtype=np.int64), data, np.frombuffer(data, np.uint8))


def _release(mapped: _Mapped, cell: int, generation: int, total: int) -> None:
    """The last view of a message is gone: drop our private copies of its pages (so that the
    mapping shows the file again), then tell the sender."""
    length = -(-total // mmap.PAGESIZE) * mmap.PAGESIZE
    if length and _has_private_pages(mapped.array.ctypes.data, length):
        mapped.data.madvise(mmap.MADV_DONTNEED, 0, length)
    mapped.cells[cell] = generation
    with mapped.lock:
        mapped.live -= 1


def _has_private_pages(address: int, length: int) -> bool:
    """Whether the process wrote to (so copied) any page of [address, address + length)."""
    first, count = address // mmap.PAGESIZE, length // mmap.PAGESIZE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            entries = np.frombuffer(os.pread(fd, count * 8, first * 8), dtype=np.uint64)
        finally:
            os.close(fd)
    except OSError:
        return True  # cannot tell: drop them all (the next message faults its pages in again)
    if len(entries) != count:
        return True
    bits = [(entries >> np.uint64(b)) & np.uint64(1) for b in (63, 62, 61)]
    present, swapped, file_page = (b.astype(bool) for b in bits)
    return bool(((present & ~file_page) | swapped).any())
