"""`python benchmarks/checkpoint_checksum.py`: what the content checksums of a checkpoint cost.

    python benchmarks/checkpoint_checksum.py --gib 1

Hashes one random in-memory buffer of --gib GiB with each candidate (zlib.crc32, which
checkpoints use, and hashlib's SHA-256, BLAKE2b, SHA-1, MD5), one core each; then writes the
same bytes as --files files and checksums them the way a save and a resume do
(``checkpoint_files.checksums``: read back from the page cache, files hashed in parallel).
Rates by wall time and by CPU time (on a shared host the second is what a core does when it
is not taken away). The last column extrapolates to a 7B full-parameter checkpoint: fp32
weights and AdamW's two moments, 12 bytes per parameter (--params, default Qwen2.5-7B's
7.62e9): the CPU seconds its checksums take (divided among the cores hashing in parallel).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import tempfile
import time
import zlib
from pathlib import Path

from hybridflow.trainer.lifecycle.checkpoint_files import checksums

HASHES = {
    "zlib.crc32": lambda data: zlib.crc32(data),
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "blake2b": lambda data: hashlib.blake2b(data).digest(),
    "sha1": lambda data: hashlib.sha1(data).digest(),
    "md5": lambda data: hashlib.md5(data).digest(),
}
BYTES_PER_PARAMETER = 12  # fp32 weight + AdamW exp_avg + exp_avg_sq


def best_rates(work, size: int, repeats: int) -> tuple[float, float]:
    """Bytes per second of ``work()`` over ``size`` bytes, by wall time and by CPU time (of
    every thread of the process): the best of ``repeats`` each. On a shared host the CPU-time
    rate is what a core does when it is not taken away."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return size / min(walls), size / min(cpus)


def measure(gib: float, files: int, repeats: int) -> list[dict]:
    size = int(gib * 2**30)
    data = memoryview(os.urandom(size))
    rows = []
    for name, digest in HASHES.items():
        wall, cpu = best_rates(functools.partial(digest, data), size, repeats)
        rows.append({"what": f"{name}, in memory, 1 thread", "wall": wall / 1e9, "cpu": cpu / 1e9})
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        part = size // files
        names = [f"__0_{i}.distcp" for i in range(files)]
        for i, name in enumerate(names):
            (directory / name).write_bytes(data[i * part : (i + 1) * part])
        wall, cpu = best_rates(
            functools.partial(checksums, directory, names), part * files, repeats
        )
        what = f"checksums() of {files} files (page cache, threads)"
        rows.append({"what": what, "wall": wall / 1e9, "cpu": cpu / 1e9})
    return rows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="buffer size (default: 1)")
    parser.add_argument("--files", type=int, default=4, help="files for checksums() (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs, best kept (default: 3)")
    parser.add_argument("--params", type=float, default=7.62e9,
                        help="parameters of the model extrapolated to (default: 7.62e9)")  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    rows = measure(args.gib, args.files, args.repeats)
    checkpoint_gb = args.params * BYTES_PER_PARAMETER / 1e9
    print(f"host: {cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"zlib {zlib.ZLIB_RUNTIME_VERSION}; "
          f"{args.gib:g} GiB buffer; best of {args.repeats}")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(
        f"| what | GB/s (wall) | GB/s of CPU time | CPU s for a {checkpoint_gb:.0f} GB checkpoint |"
    )
    print("|---|---|---|---|")
    for row in rows:
        row["checkpoint_cpu_s"] = checkpoint_gb / row["cpu"]
        print(f"| {row['what']} | {row['wall']:.2f} | {row['cpu']:.2f} | "
              f"{row['checkpoint_cpu_s']:.0f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
