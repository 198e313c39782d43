"""Single controller, SPMD worker groups: the trainer is a plain function; every heavy
operation is one call on a group of workers (see group.py for the tour).

    from hybridflow.controller import Dispatch, ResourcePool, Worker, WorkerGroup, register
"""

from hybridflow.controller.dispatch import Dispatch, register
from hybridflow.controller.errors import CallTimeoutError, WorkerDiedError, WorkerError
from hybridflow.controller.group import GroupFuture, WorkerGroup
from hybridflow.controller.resources import ResourcePool
from hybridflow.controller.worker import Worker, WorkerContext, current_context, fuse

__all__ = [
    "CallTimeoutError",
    "Dispatch",
    "GroupFuture",
    "ResourcePool",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "current_context",
    "fuse",
    "register",
]
