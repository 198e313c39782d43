"""``ray`` backend: one Ray actor per device, in one placement group per node.

``ray.init(address="auto")`` joins a running cluster; without one a local Ray is started
(a Ray that the program already initialised is used as is). Ranks are ordered by node,
then by bundle; rank 0's node address and a free port there become the torch.distributed
master. Call arguments and results travel through Ray's object store with their tensors'
bytes out of band (ray_transport.py: written once by the sender, copied once into private
memory by the reader); an argument sent to every rank is put in the store once.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

from hybridflow.controller import ray_transport
from hybridflow.controller.errors import WorkerDiedError
from hybridflow.controller.resources import ResourcePool
from hybridflow.controller.worker import RankResult, WorkerContext, WorkerHost, init_distributed


def import_ray():
    try:
        import ray
    except ImportError as exc:
        from hybridflow.install_hint import extra_install

        raise ImportError(
            f"backend='ray' needs Ray: {extra_install('ray')} (or pip install ray)"
        ) from exc
    return ray


def ensure_ray_initialized() -> None:
    ray = import_ray()
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto")  # an existing cluster (RAY_ADDRESS or a local head node)
    except ConnectionError:
        ray.init()


_CLOSE_S = 5.0  # how long shutdown waits for the workers' close hooks
_CLOSE_BUSY_S = 0.5  # ... when a call still runs (it would not reach its close soon)


class _RayHost:
    """The actor: a WorkerHost plus what placement needs to know about its node."""

    def __init__(self, driver_sys_path: list[str]) -> None:
        # Like multiprocessing's spawn: modules the driver can import (its worker classes,
        # e.g. from a script's directory) become importable here too, before any call's
        # arguments are unpickled.
        import sys

        sys.path.extend(p for p in driver_sys_path if p not in sys.path)
        self.host = WorkerHost()

    def node(self) -> tuple[str, str, int]:
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def start(
        self,
        worker_cls: type,
        context: WorkerContext,
        master: tuple[str, int],
        timeout_s: float,
        init_kwargs: dict,
    ) -> RankResult:
        try:
            init_distributed(context, master[0], master[1], timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported to the controller
            import traceback

            return RankResult(
                error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
            )
        return self.host.start(worker_cls, context, init_kwargs)

    def call(
        self, path: str, kwarg_names: list[str], *encoded: ray_transport.Encoded
    ) -> ray_transport.Encoded:
        # Arguments arrive flat: Ray resolves ObjectRefs only at the top level.
        try:
            values = [ray_transport.decode(e) for e in encoded]
        except Exception as exc:  # noqa: BLE001 - e.g. an argument class this process cannot import
            error = f"the worker could not unpickle the arguments: {exc!r}"
            return ray_transport.encode(RankResult(error=error))
        n_args = len(values) - len(kwarg_names)
        kwargs = dict(zip(kwarg_names, values[n_args:]))
        outcome = self.host.call(path, tuple(values[:n_args]), kwargs)
        try:
            return ray_transport.encode(outcome)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            error = f"{path} returned a value that cannot be sent: {exc}"
            return ray_transport.encode(RankResult(error=error))

    def close(self) -> RankResult:
        return self.host.close()

    def kill_children(self) -> None:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


class RayBackend:
    name = "ray"

    def __init__(
        self,
        worker_cls: type,
        pool: ResourcePool,
        group: str,
        init_kwargs: dict,
        start_timeout_s: float,
        collective_timeout_s: float,
    ) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ensure_ray_initialized()
        self.ray, self.group, self.world_size = ray, group, pool.world_size
        self.actors: list[Any] = []
        self.placement_groups = []
        # Calls submitted from several controller threads (the async mode's rollout producer
        # and the trainer) reach every rank in one order: Ray orders an actor's tasks by
        # submission from this process, so collectives of different calls cannot cross.
        self.lock = threading.Lock()
        self.unsettled: set[Future] = set()  # calls still running: shutdown waits less
        bundle = {"CPU": pool.cpus_per_worker, **({"GPU": 1} if pool.use_gpu else {})}
        remote_host = ray.remote(_RayHost)
        try:
            for per_node in pool.per_node:
                pg = placement_group([dict(bundle)] * per_node, strategy="STRICT_PACK")
                self.placement_groups.append(pg)
                try:
                    ray.get(pg.ready(), timeout=start_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    raise TimeoutError(
                        f"Ray could not reserve {per_node} x {bundle} on one node within "
                        f"{start_timeout_s:.0f}s; free resources: {ray.available_resources()}. "
                        "Reduce the pool, lower cpus_per_worker, or add nodes."
                    ) from None
                for index in range(per_node):
                    strategy = PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index
                    )
                    options = dict(
                        num_cpus=pool.cpus_per_worker,
                        num_gpus=1 if pool.use_gpu else 0,
                        scheduling_strategy=strategy,
                    )
                    self.actors.append(remote_host.options(**options).remote(sys.path))
            nodes = ray.get([a.node.remote() for a in self.actors], timeout=start_timeout_s)
            order = rank_order([node_id for _, node_id, _ in nodes])
            self.actors = [self.actors[i] for i in order]
            nodes = [nodes[i] for i in order]
            self._pids = [pid for _, _, pid in nodes]
            master = (
                nodes[0][0],
                ray.get(self.actors[0].free_port.remote(), timeout=start_timeout_s),
            )
            contexts = _contexts(nodes, pool, group)
            starts = [
                a.start.remote(worker_cls, c, master, collective_timeout_s, init_kwargs)
                for a, c in zip(self.actors, contexts)
            ]
            self.start_outcomes = _first_failure_or_all(ray, starts, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def submit(self, path: str, per_rank: list[tuple[tuple, dict]]) -> list[Future]:
        # id(value) -> what goes to Ray: a value sent to many ranks is encoded (and stored) once
        sent: dict[int, Any] = {}

        def send(value: Any) -> Any:
            if id(value) not in sent:
                sent[id(value)] = _store_if_large(self.ray, ray_transport.encode(value))
            return sent[id(value)]

        futures = []
        with self.lock:
            for rank, (args, kwargs) in enumerate(per_rank):
                values = [send(v) for v in [*args, *kwargs.values()]]
                ref = self.actors[rank].call.remote(path, list(kwargs), *values)
                futures.append(self._wrap(ref, rank, path))
        return futures

    def _wrap(self, ref: Any, rank: int, path: str) -> Future:
        out: Future = Future()
        self.unsettled.add(out)

        def settle(ray_future: Future) -> None:
            self.unsettled.discard(out)
            exc = ray_future.exception()
            if exc is None:
                try:
                    out.set_result(ray_transport.decode(ray_future.result()))
                except Exception as decode_exc:  # noqa: BLE001 - e.g. out of memory
                    out.set_exception(decode_exc)
            elif isinstance(exc, self.ray.exceptions.RayActorError):
                out.set_exception(
                    WorkerDiedError(self.group, "", rank, path, f"Ray actor died: {exc}")
                )
            else:
                out.set_exception(exc)

        ref.future().add_done_callback(settle)
        return out

    def check_alive(self) -> None:
        """Ray reports dead actors through the call futures."""

    def pids(self) -> list[int]:
        return list(self._pids)

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if not self.ray.is_initialized():
            return  # Ray shut down first (its atexit runs before ours): actors are gone
        # The workers' close hook, queued after their calls; busy ones get less time.
        grace_s = _CLOSE_BUSY_S if self.unsettled else _CLOSE_S
        try:
            self.ray.get([a.close.remote() for a in self.actors], timeout=grace_s)
        except Exception:  # noqa: BLE001 - a dead or hung actor is killed below anyway
            pass
        try:
            self.ray.get([a.kill_children.remote() for a in self.actors], timeout=5)
        except Exception:  # noqa: BLE001 - dead actors cannot clean up; kill them anyway
            pass
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self.actors, self.placement_groups = [], []


# Below this many tensor bytes an argument travels inside the call (Ray inlines small ones
# anyway); above, ray.put stores it once for all ranks that receive it.
_STORE_MIN_BYTES = 1 << 20


def _store_if_large(ray: Any, encoded: ray_transport.Encoded) -> Any:
    return ray.put(encoded) if encoded.nbytes >= _STORE_MIN_BYTES else encoded


def _first_failure_or_all(ray: Any, refs: list, timeout_s: float) -> list[RankResult]:
    """Start outcomes in rank order; returns as soon as one rank fails (the others may wait
    for it in a collective of their ``__init__``)."""
    outcomes: dict[int, RankResult] = {}
    index = {ref: rank for rank, ref in enumerate(refs)}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not done:
            raise TimeoutError(f"Ray workers did not start within {timeout_s:.0f}s")
        rank = index[done[0]]
        outcomes[rank] = ray.get(done[0])
        if outcomes[rank].error:
            break
    return [outcomes.get(r, RankResult()) for r in range(len(refs))]


def rank_order(node_ids: list[str]) -> list[int]:
    """Actor indices in rank order: grouped by node (in order of first appearance), then by
    creation order, so that the ranks of one node are consecutive (local ranks 0..k-1)."""
    first_seen: dict[str, int] = {}
    for index, node_id in enumerate(node_ids):
        first_seen.setdefault(node_id, index)
    return sorted(range(len(node_ids)), key=lambda i: (first_seen[node_ids[i]], i))


def _contexts(
    nodes: list[tuple[str, str, int]], pool: ResourcePool, group: str
) -> list[WorkerContext]:
    """Contexts for actors already in rank order; ``nodes`` holds (ip, node id, pid)."""
    contexts, seen = [], {}
    per_node_count = {}
    for _, node_id, _ in nodes:
        per_node_count[node_id] = per_node_count.get(node_id, 0) + 1
    for rank, (_, node_id, _) in enumerate(nodes):
        local_rank = seen.get(node_id, 0)
        seen[node_id] = local_rank + 1
        # Ray restricts CUDA_VISIBLE_DEVICES to the actor's GPU, which is then cuda:0.
        device = "cuda:0" if pool.use_gpu else "cpu"
        contexts.append(
            WorkerContext(
                rank, len(nodes), local_rank, per_node_count[node_id], device, group, "ray"
            )
        )
    return contexts
