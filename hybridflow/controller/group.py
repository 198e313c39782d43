"""``WorkerGroup``: the controller's handle on a set of SPMD workers.

    group = WorkerGroup(ActorRolloutRef, pool=ResourcePool(gpus=8), backend="local", config=cfg)
    out = group.generate(batch)                   # blocking
    future = group.generate.remote(batch)         # returns at once
    ...                                           # overlap other work
    out = future.get(timeout=600)

The same worker class runs under every backend. Failures surface as ``WorkerError``
(a worker raised; names group, role, rank, method, remote traceback), ``WorkerDiedError``
(a process is gone; the group shuts itself down) or ``CallTimeoutError``. Groups are shut
down by ``shutdown()``, on leaving a ``with`` block, and at interpreter exit (also after
Ctrl-C), so no worker process outlives the controller.
"""

from __future__ import annotations

import atexit
import itertools
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from hybridflow.controller.dispatch import Dispatch, gather, scatter
from hybridflow.controller.errors import CallTimeoutError, WorkerDiedError, WorkerError
from hybridflow.controller.resources import ResourcePool
from hybridflow.controller.worker import RankResult, resolve_method, role_classes

BACKENDS = ("inprocess", "local", "ray")
_POLL_S = 0.25
# Strong references: a group lives until shutdown() (or exit), even if the trainer drops it.
_live_groups: set[WorkerGroup] = set()
_group_ids = itertools.count()


class WorkerGroup:
    """``world_size`` instances of ``worker_cls``, one per device of ``pool``.

    Args:
        worker_cls: a class whose remote methods carry ``@register``; or ``fuse(...)``.
        pool: devices; default one GPU if present, else one CPU worker.
        backend: ``"inprocess"``, ``"local"`` or ``"ray"``.
        name: used in process names and error messages (default: the class name).
        call_timeout_s: timeout of blocking calls (``.remote().get()`` takes its own).
        start_timeout_s: how long workers may take to start and build themselves.
        collective_timeout_s: torch.distributed timeout of every collective (local, ray).
        **init_kwargs: passed to ``worker_cls(**init_kwargs)`` on every rank.
    """

    def __init__(
        self,
        worker_cls: type,
        pool: ResourcePool | None = None,
        backend: str = "inprocess",
        *,
        name: str | None = None,
        call_timeout_s: float | None = 3600.0,
        start_timeout_s: float = 600.0,
        collective_timeout_s: float = 1800.0,
        rendezvous_host: str = "127.0.0.1",
        **init_kwargs: Any,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        self.worker_cls = worker_cls
        self.pool = pool or ResourcePool.default()
        self.backend_name = backend
        self.name = name or f"{worker_cls.__name__}{next(_group_ids)}"
        self.call_timeout_s = call_timeout_s
        self.world_size = self.pool.world_size
        self._closed = False
        self._backend = _make_backend(
            backend,
            worker_cls,
            self.pool,
            self.name,
            init_kwargs,
            start_timeout_s,
            collective_timeout_s,
            rendezvous_host,
        )
        _live_groups.add(self)
        _exit_cleanly_on_sigterm()
        failed = [(rank, o) for rank, o in enumerate(self._backend.start_outcomes) if o.error]
        if failed:
            self.shutdown()
            rank, outcome = failed[0]
            raise WorkerError(
                self.name,
                "",
                rank,
                f"{worker_cls.__name__}.__init__",
                outcome.error,
                outcome.traceback,
                user_error=outcome.user_error,
            )

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if attr in role_classes(self.worker_cls):
            return RoleView(self, attr)
        return RemoteMethod(self, attr)

    def pids(self) -> list[int]:
        """Process id of each rank (the controller's own for ``inprocess``)."""
        return self._backend.pids()

    def shutdown(self) -> None:
        """Stop every worker (and the processes they started). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        _live_groups.discard(self)
        self._backend.shutdown()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, backend={self.backend_name!r}, {self.pool})"

    def _call(self, path: str, args: tuple, kwargs: dict) -> GroupFuture:
        if self._closed:
            raise RuntimeError(f"worker group {self.name!r} is shut down")
        mode, role = resolve_method(self.worker_cls, path)
        per_rank, pad_size = scatter(mode, self.world_size, args, kwargs)
        futures = self._backend.submit(path, per_rank)
        return GroupFuture(self, path, role, mode, futures, pad_size)


class RoleView:
    """``group.actor``: the methods of one role of a fused worker."""

    def __init__(self, group: WorkerGroup, role: str) -> None:
        self._group, self._role = group, role

    def __getattr__(self, attr: str) -> RemoteMethod:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return RemoteMethod(self._group, f"{self._role}.{attr}")


class RemoteMethod:
    """``group.method``: call it to block, or ``.remote(...)`` for a ``GroupFuture``."""

    def __init__(self, group: WorkerGroup, path: str) -> None:
        self.group, self.path = group, path
        resolve_method(group.worker_cls, path)  # unknown or unregistered: fail here, clearly

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.remote(*args, **kwargs).get(timeout=self.group.call_timeout_s)

    def remote(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self.group._call(self.path, args, kwargs)


class GroupFuture:
    """The pending result of one call on every rank of a group."""

    def __init__(
        self,
        group: WorkerGroup,
        path: str,
        role: str,
        mode: Dispatch,
        futures: list[Future],
        pad_size: int,
    ) -> None:
        self._group, self._path, self._role, self._mode = group, path, role, mode
        self._futures, self._pad_size = futures, pad_size
        self._result: Any = None
        self._has_result = False

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank and combine the results (see ``Dispatch``).

        Raises the first failure as soon as it is known: a rank that raised, or a dead
        worker (detected within a fraction of a second), without waiting for the others.
        """
        if self._has_result:
            return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = set(self._futures)
        while pending:
            step = (
                _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            )
            done, pending = wait(pending, timeout=step, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=self._futures.index):
                self._raise_if_failed(future)
            if pending:
                self._group._backend.check_alive()
                if deadline is not None and time.monotonic() >= deadline:
                    running = [r for r, f in enumerate(self._futures) if f in pending]
                    raise CallTimeoutError(
                        f"group {self._group.name!r}: {self._path} did not finish within {timeout}s "
                        f"(ranks still running: {running}); raise the timeout or look for a hung collective"
                    )
        values = [f.result().value for f in self._futures]
        self._result = gather(self._mode, values, self._pad_size, self._path)
        self._has_result = True
        return self._result

    def _raise_if_failed(self, future: Future) -> None:
        rank = self._futures.index(future)
        exc = future.exception()
        if isinstance(exc, WorkerDiedError):
            self._group.shutdown()  # the others may wait for it in a collective forever
            raise WorkerDiedError(
                self._group.name,
                self._role,
                rank,
                self._path,
                exc.error + "; the group was shut down",
            )
        if exc is not None:  # e.g. Ray could not deliver the arguments or the result
            raise WorkerError(
                self._group.name, self._role, rank, self._path, f"{type(exc).__name__}: {exc}"
            ) from exc
        outcome: RankResult = future.result()
        if outcome.error:
            raise WorkerError(
                self._group.name,
                self._role,
                rank,
                self._path,
                outcome.error,
                outcome.traceback,
                user_error=outcome.user_error,
            )


def _make_backend(
    backend: str,
    worker_cls: type,
    pool: ResourcePool,
    name: str,
    init_kwargs: dict,
    start_timeout_s: float,
    collective_timeout_s: float,
    rendezvous_host: str,
):
    if backend == "inprocess":
        from hybridflow.controller.inprocess import InProcessBackend

        return InProcessBackend(worker_cls, pool, name, init_kwargs, start_timeout_s)
    if backend == "local":
        from hybridflow.controller.local import LocalBackend

        return LocalBackend(
            worker_cls,
            pool,
            name,
            init_kwargs,
            start_timeout_s,
            collective_timeout_s,
            rendezvous_host,
        )
    from hybridflow.controller.ray_backend import RayBackend

    return RayBackend(worker_cls, pool, name, init_kwargs, start_timeout_s, collective_timeout_s)


def _exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from a job scheduler) into SystemExit so that the atexit shutdown
    runs, unless the program installed its own handler. Main thread only (Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@atexit.register
def _shutdown_all() -> None:
    # Runs on normal exit, after an uncaught exception and after Ctrl-C (KeyboardInterrupt).
    for group in list(_live_groups):
        try:
            group.shutdown()
        except Exception:  # noqa: BLE001 - keep shutting the others down
            pass
