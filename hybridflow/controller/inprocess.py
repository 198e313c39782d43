"""``inprocess`` backend: the workers are objects in the controller process.

No subprocess, no Ray, no pickling: arguments are passed by reference. Each rank runs on
its own thread, so that ``.remote()`` calls on different groups overlap (torch releases the
GIL in its kernels) and one worker always runs on the same thread (CUDA device and stream
are per thread). torch.distributed is not initialised: use world size 1 for code with
collectives. A call that times out keeps running (threads cannot be killed).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

from hybridflow.controller.resources import ResourcePool
from hybridflow.controller.worker import RankResult, WorkerContext, WorkerHost

_JOIN_TIMEOUT_S = 30.0  # a call still running (timed out earlier) must not hang shutdown


class _RankThread:
    def __init__(self, name: str) -> None:
        self.host = WorkerHost()
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn = job
            if future.set_running_or_notify_cancel():
                future.set_result(fn())

    def submit(self, fn) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn))
        return future


class InProcessBackend:
    name = "inprocess"

    def __init__(
        self,
        worker_cls: type,
        pool: ResourcePool,
        group: str,
        init_kwargs: dict,
        start_timeout_s: float,
    ) -> None:
        self.world_size = pool.world_size
        self.ranks = [_RankThread(f"hybridflow-{group}-{r}") for r in range(self.world_size)]
        starts = []
        for rank, worker in enumerate(self.ranks):
            device = pool.device_for(rank)
            context = WorkerContext(
                rank, self.world_size, rank, self.world_size, device, group, self.name
            )
            starts.append(
                worker.submit(
                    lambda w=worker, c=context: _start(w.host, worker_cls, c, init_kwargs)
                )
            )
        self.start_outcomes: list[RankResult] = [f.result(timeout=start_timeout_s) for f in starts]

    def submit(self, path: str, per_rank: list[tuple[tuple, dict]]) -> list[Future]:
        return [
            w.submit(lambda w=w, a=a, k=k: w.host.call(path, a, k))
            for w, (a, k) in zip(self.ranks, per_rank)
        ]

    def check_alive(self) -> None:
        """Threads do not die on their own: worker exceptions are captured as Outcomes."""

    def pids(self) -> list[int]:
        import os

        return [os.getpid()] * self.world_size

    def shutdown(self) -> None:
        for worker in self.ranks:  # the close hook runs on the rank's thread, after its calls
            worker.submit(worker.host.close)
            worker.jobs.put(None)
        # Let each rank thread finish before the interpreter exits: a thread that has run
        # torch code and is still unwinding while the process tears down aborts it
        # ("terminate called without an active exception", seen in 6 of 12 runs).
        for worker in self.ranks:
            if worker.thread is not threading.current_thread():
                worker.thread.join(timeout=_JOIN_TIMEOUT_S)


def _start(
    host: WorkerHost, worker_cls: type, context: WorkerContext, init_kwargs: dict[str, Any]
) -> RankResult:
    if context.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(context.device)
    return host.start(worker_cls, context, init_kwargs)
