"""`python benchmarks/shared_memory_steps.py`: where the local backend's shared-memory transfer
spends its time, step by step, in one process (docs/performance-host.md "Controller overhead").

    python benchmarks/shared_memory_steps.py [--mib 204] [--rounds 7]

A fresh ``/dev/shm`` file per message (the local backend before segments were reused), each
way of filling it, then a receiver's private mapping read page by page (with or without
MADV_POPULATE_READ), unmapped, and the file unlinked (the kernel frees its pages); against a
segment kept mapped by both sides (segment_pool.py): one memcpy per column, numpy's or torch's. The
variants take turns in each round; medians in ms.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
import uuid

import numpy as np
import torch

PAGE = 4096
COLUMNS = 14
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14; Python 3.11's mmap lacks them


def touch(buffer: np.ndarray) -> int:
    return int(buffer[::PAGE].sum())


def fill_pwrite(fd: int, source: np.ndarray, allocate: bool) -> None:
    if allocate:
        os.posix_fallocate(fd, 0, source.nbytes)
    else:
        os.ftruncate(fd, source.nbytes)
    view, offset = memoryview(source), 0
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def fill_mapping(fd: int, source: np.ndarray, populate: str) -> None:
    os.ftruncate(fd, source.nbytes)
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate == "MAP_POPULATE" else 0)
    mapping = mmap.mmap(fd, source.nbytes, flags=flags)
    if populate == "MADV_POPULATE_WRITE":
        mapping.madvise(MADV_POPULATE_WRITE)
    np.copyto(np.frombuffer(mapping, np.uint8), source)
    mapping.close()


SENDERS = {
    "ftruncate + pwrite (before)": lambda fd, s: fill_pwrite(fd, s, allocate=False),
    "fallocate + pwrite": lambda fd, s: fill_pwrite(fd, s, allocate=True),
    "ftruncate + mmap + memcpy": lambda fd, s: fill_mapping(fd, s, ""),
    "... + MAP_POPULATE": lambda fd, s: fill_mapping(fd, s, "MAP_POPULATE"),
    "... + MADV_POPULATE_WRITE": lambda fd, s: fill_mapping(fd, s, "MADV_POPULATE_WRITE"),
}


def receive(path: str, size: int, populate: bool, times: dict) -> None:
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(
        fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )  # as transport._map_segment
    os.close(fd)
    if populate:
        mapping.madvise(MADV_POPULATE_READ)
    array = np.frombuffer(mapping, np.uint8)
    touch(array)
    name = "receiver: map + read every page" + (" (MADV_POPULATE_READ)" if populate else "")
    times.setdefault(name, []).append(time.perf_counter() - start)
    start = time.perf_counter()
    del array
    mapping.close()
    times.setdefault("receiver: unmap", []).append(time.perf_counter() - start)


def one_round(source: np.ndarray, reused: dict, times: dict) -> None:
    def timed(name, fn, *args):
        start = time.perf_counter()
        fn(*args)
        times.setdefault(name, []).append(time.perf_counter() - start)

    for name, send in SENDERS.items():
        path = os.path.join("/dev/shm", "hybridflow-steps-" + uuid.uuid4().hex)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            timed("sender: " + name, send, fd, source)
            os.close(fd)
            for populate in (False, True):
                receive(path, source.nbytes, populate, times)
        finally:
            timed("unlink (the kernel frees the pages)", os.unlink, path)
    destination = reused["array"]
    timed("reused segment: np.copyto per column (used)", copy_columns, destination, source, False)
    timed("reused segment: torch copy_ per column", copy_columns, destination, source, True)
    timed("reused segment: receiver reads every page", touch, destination)


def copy_columns(destination: np.ndarray, source: np.ndarray, with_torch: bool) -> None:
    """As a pool writes a message: one copy per tensor (a GRPO update batch has 14)."""
    bounds = [source.nbytes * i // COLUMNS for i in range(COLUMNS + 1)]
    for start, stop in zip(bounds, bounds[1:]):
        if with_torch:
            torch.from_numpy(destination[start:stop]).copy_(torch.from_numpy(source[start:stop]))
        else:
            np.copyto(destination[start:stop], source[start:stop])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=204)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    source = np.random.default_rng(0).integers(0, 255, args.mib << 20, dtype=np.uint8)
    path = os.path.join("/dev/shm", "hybridflow-steps-" + uuid.uuid4().hex)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, source.nbytes)
    segment = mmap.mmap(fd, source.nbytes, flags=mmap.MAP_SHARED)
    os.close(fd)
    os.unlink(path)
    array = np.frombuffer(segment, np.uint8)
    reused = {"array": array}
    np.copyto(array, source)  # mapped and populated once, as a pool's segment after its first use
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        one_round(source, reused, times)
    print(f"{args.mib} MiB, {args.rounds} rounds, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), {os.cpu_count()} CPUs")  # fmt: skip
    for name, values in times.items():
        print(f"{name:<58} {statistics.median(values) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
