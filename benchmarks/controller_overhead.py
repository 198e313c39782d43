"""`python benchmarks/controller_overhead.py`: per-call overhead and Batch bandwidth per backend.

    python benchmarks/controller_overhead.py [--backends inprocess local ray] [--world-size 2]

For each backend, with one group of ``--world-size`` CPU workers:
- ``noop``: a ONE_TO_ALL call without arguments (pure dispatch + round trip), median of N;
- ``send``: ONE_TO_ALL of a 1024 x 4096 int64 Batch (32 MiB to every rank); the worker
  sums it, so the bytes are really read;
- ``echo``: DP_SPLIT of the same Batch, each rank returns its chunk (32 MiB there and back).
Bandwidth = bytes moved / median time (inprocess moves nothing: its row is the compute floor).
``local-pickle`` is the local backend with shared memory turned off (tensor bytes inline in
the pipe), measured in the same run as the comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hybridflow.controller import Dispatch, ResourcePool, Worker, WorkerGroup, register
from hybridflow.protocol import Batch

MiB = 1 << 20


class BenchWorker(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def consume(self, batch: Batch) -> int:
        return int(batch["input_ids"].sum())

    @register(dispatch=Dispatch.DP_SPLIT)
    def echo(self, batch: Batch) -> Batch:
        return batch


def median_seconds(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(backend: str, world_size: int, batch: Batch, repeats: int) -> dict:
    label = backend
    if backend == "local-pickle":
        os.environ["HYBRIDFLOW_SHM_MIN_BYTES"] = str(1 << 62)  # read by controller and workers
        backend = "local"
    start = time.perf_counter()
    group = WorkerGroup(BenchWorker, ResourcePool(cpus=world_size, cpus_per_worker=0.5), backend)
    startup = time.perf_counter() - start
    nbytes = batch["input_ids"].numel() * batch["input_ids"].element_size()
    try:
        noop = median_seconds(group.noop, repeats * 10)
        send = median_seconds(lambda: group.consume(batch), repeats)
        echo = median_seconds(lambda: group.echo(batch), repeats)
    finally:
        group.shutdown()
        os.environ.pop("HYBRIDFLOW_SHM_MIN_BYTES", None)
    return {
        "backend": label,
        "startup_s": startup,
        "noop_us": noop * 1e6,
        "send_ms": send * 1e3,
        "send_MiBps": nbytes * world_size / MiB / send,
        "echo_ms": echo * 1e3,
        "echo_MiBps": 2 * nbytes / MiB / echo,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--backends", nargs="+", default=["inprocess", "local", "local-pickle", "ray"]
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    batch = Batch(
        {"input_ids": torch.randint(0, 150_000, (args.rows, args.cols), dtype=torch.int64)}
    )
    print(
        f"Batch: {args.rows} x {args.cols} int64 = {args.rows * args.cols * 8 / MiB:.0f} MiB; world size {args.world_size}; torch {torch.__version__}; {os.cpu_count()} CPUs"
    )
    if "ray" in args.backends:
        import ray

        ray.init(num_cpus=max(2, args.world_size), include_dashboard=False, log_to_driver=False)
    header = f"{'backend':<13} {'start s':>8} {'noop us':>9} {'send ms':>8} {'send MiB/s':>11} {'echo ms':>8} {'echo MiB/s':>11}"
    print(header)
    print("-" * len(header))
    for backend in args.backends:
        r = measure(backend, args.world_size, batch, args.repeats)
        print(
            f"{r['backend']:<13} {r['startup_s']:>8.1f} {r['noop_us']:>9.0f} {r['send_ms']:>8.1f} "
            f"{r['send_MiBps']:>11.0f} {r['echo_ms']:>8.1f} {r['echo_MiBps']:>11.0f}"
        )


if __name__ == "__main__":
    main()
