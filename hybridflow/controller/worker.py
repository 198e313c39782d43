"""What runs inside a worker: its context (rank, device...), role fusion, and the host that
builds the worker object and runs calls on it, turning exceptions into plain data."""

from __future__ import annotations

import copyreg
import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

from hybridflow.controller.dispatch import Dispatch, dispatch_of
from hybridflow.errors import UserError


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker runs. Set by the backend before the worker's ``__init__``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: str
    """``"cuda:<i>"`` or ``"cpu"``; torch.cuda.set_device has been called for CUDA."""
    group: str
    """Name of the WorkerGroup, used in error messages."""
    backend: str
    """``"inprocess"``, ``"local"`` or ``"ray"``. torch.distributed is initialised for the
    last two (gloo on CPU, NCCL on GPU); ``inprocess`` leaves it alone."""
    colocated: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Role objects fused into this process by ``fuse``, by role name, e.g. a rollout role
    reads ``colocated["actor"]`` to use the actor's weights in place."""


_local = threading.local()


def current_context() -> WorkerContext:
    """The context of the worker running on this thread (inside worker code only)."""
    ctx = getattr(_local, "context", None)
    if ctx is None:
        raise RuntimeError("current_context() is only available inside a worker")
    return ctx


class Worker:
    """Convenience mix-in giving ``self.rank``, ``self.world_size``, ``self.device``...

    Any class can be a worker: the backend sets ``self.context`` before calling ``__init__``;
    this class only adds read-only shortcuts to it. The one hook is optional and not part of
    this class: a worker's ``close()`` method, if it has one, runs when its group shuts down
    (on every backend, on the worker's own thread), e.g. to stop a thread it started.
    """

    context: WorkerContext

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def local_rank(self) -> int:
        return self.context.local_rank

    @property
    def device(self) -> str:
        return self.context.device


FUSED_ATTR = "__hybridflow_roles__"


class _FusedMeta(type):
    """Metaclass of ``fuse`` classes. They are built at run time, so they cannot be pickled
    by name; they pickle as their role spec and are rebuilt in the receiving process."""


def fuse(**roles: type | tuple[type, dict[str, Any]]) -> type:
    """One worker class holding several roles in one process per device (the hybrid engine).

    ``fuse(actor=Actor, rollout=Rollout, ref=(Ref, {"offload": True}))``: the group's init
    kwargs go to every role, plus the role's own extra kwargs; roles are built in the given
    order and see the earlier ones in ``context.colocated``. Call them on the group as
    ``group.actor.update(batch)``; the same trainer code works with separate groups
    (``actor = WorkerGroup(Actor, ...)``) for split placement.
    """
    if not roles:
        raise ValueError("fuse needs at least one role, e.g. fuse(actor=Actor, rollout=Rollout)")
    specs = {name: spec if isinstance(spec, tuple) else (spec, {}) for name, spec in roles.items()}
    name = "Fused_" + "_".join(specs)
    attrs = {
        "__init__": _fused_init,
        "close": _fused_close,
        "_role_specs": specs,
        FUSED_ATTR: {n: c for n, (c, _) in specs.items()},
    }
    return _FusedMeta(name, (Worker,), attrs)


def _fused_init(self, **kwargs: Any) -> None:
    self.roles = {}
    for name, (cls, extra) in type(self)._role_specs.items():
        obj = construct(cls, self.context, {**kwargs, **extra})
        self.roles[name] = obj
        self.context.colocated[name] = obj


def _fused_close(self) -> None:
    """Each role's close(), later roles first (they may use the earlier ones); a role that
    fails to close does not keep the others open."""
    errors = []
    for obj in reversed(list(getattr(self, "roles", {}).values())):
        try:
            close_worker(obj)
        except Exception as exc:  # noqa: BLE001 - raised after the other roles closed
            errors.append(exc)
    if errors:
        raise errors[0]


def close_worker(worker: Any) -> None:
    """Call ``worker.close()`` if the worker defines one (its shutdown hook)."""
    close = getattr(worker, "close", None)
    if callable(close):
        close()


def _rebuild_fused(specs: dict) -> type:
    return fuse(**specs)


copyreg.pickle(_FusedMeta, lambda cls: (_rebuild_fused, (cls._role_specs,)))


def role_classes(worker_cls: type) -> dict[str, type]:
    return getattr(worker_cls, FUSED_ATTR, {})


def resolve_method(worker_cls: type, path: str) -> tuple[Dispatch, str]:
    """Dispatch mode of ``path`` (``"generate"`` or ``"actor.update"`` on a fused class)."""
    cls, role, name = worker_cls, None, path
    if "." in path:
        role, name = path.split(".", 1)
        cls = role_classes(worker_cls).get(role)
        if cls is None:
            raise AttributeError(f"{worker_cls.__name__} has no role {role!r}")
    mode = dispatch_of(getattr(cls, name, None))
    if mode is None:
        registered = sorted(n for n in dir(cls) if dispatch_of(getattr(cls, n, None)))
        raise AttributeError(
            f"{cls.__name__}.{name} is not a remote method; registered: {registered} "
            "(mark methods with @register(dispatch=...))"
        )
    return mode, role or ""


def construct(cls: type, context: WorkerContext, kwargs: dict[str, Any]) -> Any:
    """Build a worker object with ``context`` already set, so ``__init__`` can use it."""
    obj = cls.__new__(cls)
    obj.context = context
    obj.__init__(**kwargs)
    return obj


@dataclass
class RankResult:
    """Result of one call on one rank, as plain data (exceptions may not pickle)."""

    value: Any = None
    error: str | None = None
    """``"ExceptionType: message"`` when the call raised."""
    traceback: str = ""
    user_error: bool = False
    """The exception was a hybridflow UserError: its message is what the user must see."""


class WorkerHost:
    """Owns the worker object of one rank and runs calls on it."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.context: WorkerContext | None = None

    def start(self, worker_cls: type, context: WorkerContext, init_kwargs: dict) -> RankResult:
        self.context = context
        _local.context = context
        return _capture(
            lambda: setattr(self, "worker", construct(worker_cls, context, init_kwargs))
        )

    def call(self, path: str, args: tuple, kwargs: dict) -> RankResult:
        _local.context = self.context
        return _capture(lambda: self._bound(path)(*args, **kwargs), range_name=path)

    def close(self) -> RankResult:
        """The worker's shutdown hook (``close_worker``); nothing if it never started."""
        if self.worker is None:
            return RankResult()
        _local.context = self.context
        return _capture(lambda: close_worker(self.worker))

    def _bound(self, path: str):
        target, name = self.worker, path
        if "." in path:
            role, name = path.split(".", 1)
            target = self.worker.roles[role]
        return getattr(target, name)


def _capture(fn, range_name: str | None = None) -> RankResult:
    try:
        if range_name is None:
            return RankResult(value=fn())
        # A named range per call, so a profile (torch, or NVTX under emit_nvtx) shows which
        # worker call each kernel belongs to; a few microseconds when nothing records.
        from torch.profiler import record_function

        with record_function(range_name):
            return RankResult(value=fn())
    except BaseException as exc:  # noqa: BLE001 - reported to the controller, which re-raises
        # Drop this frame and the host's lambda: the traceback starts in worker code.
        tb = exc.__traceback__.tb_next.tb_next or exc.__traceback__
        lines = traceback.format_exception(type(exc), exc, tb)
        return RankResult(
            error=f"{type(exc).__name__}: {exc}",
            traceback="".join(lines),
            user_error=isinstance(exc, UserError),
        )


def init_distributed(
    context: WorkerContext,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    listen_host: str | None = None,
) -> None:
    """torch.distributed for one worker: NCCL on its GPU, gloo on CPU; env vars set for
    libraries that read them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...).

    ``listen_host``: the address rank 0's rendezvous store listens on (the local backend
    passes 127.0.0.1); None lets torch listen on every interface, as Ray's nodes need."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(context.rank),
        WORLD_SIZE=str(context.world_size),
        LOCAL_RANK=str(context.local_rank),
        LOCAL_WORLD_SIZE=str(context.local_world_size),
    )
    kwargs: dict[str, Any] = {}
    if context.device.startswith("cuda"):
        torch.cuda.set_device(context.device)
        kwargs["device_id"] = torch.device(context.device)
        share_host_cores(context.local_world_size)
    if listen_host is not None:
        kwargs["store"] = _rendezvous_store(context, listen_host, master_addr, master_port,
                                            timedelta(seconds=timeout_s))  # fmt: skip
    dist.init_process_group(
        backend="nccl" if context.device.startswith("cuda") else "gloo",
        rank=context.rank,
        world_size=context.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def _rendezvous_store(context: WorkerContext, listen_host: str, master_addr: str, port: int,
                      timeout):  # fmt: skip
    """A TCPStore whose server (rank 0) listens on ``listen_host`` only: torch's own binds
    every interface, which would let anyone on the network talk to the store."""
    import socket

    import torch.distributed as dist

    if context.rank != 0:
        return dist.TCPStore(master_addr, port, context.world_size, False, timeout)
    family = socket.AF_INET6 if ":" in listen_host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((listen_host, port))
    listener.listen(128)
    # detach: the store owns the descriptor now (closing the socket object would close it)
    return dist.TCPStore(master_addr, port, context.world_size, True, timeout,
                         master_listen_fd=listener.detach())  # fmt: skip


def share_host_cores(local_world_size: int) -> None:
    """GPU ranks on one host split its cores between their CPU thread pools. torch's default
    gives every process all cores, so N ranks start N × cores OpenMP threads whose spinning
    competes with each rank's kernel-launching thread (torchrun sets OMP_NUM_THREADS=1 for
    the same reason)."""
    import torch

    if local_world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def destroy_distributed() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
