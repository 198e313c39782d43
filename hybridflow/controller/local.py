"""``local`` backend: one process per device on this node, forked from a fork server that has
imported torch once (fork_server.py), or spawned where the platform has no fork server.

Each worker initialises torch.distributed (NCCL on GPU, gloo on CPU) and then serves calls
from a pipe; tensors travel through shared memory that each side reuses from call to call
(transport.py, segment_pool.py). A thread per worker reads its replies; a closed pipe means
the process died, and every pending call fails at once with ``WorkerDiedError``. Workers ignore SIGINT (the controller decides when they stop)
and exit by themselves when the controller process disappears.
"""

from __future__ import annotations

import itertools
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import Future

from hybridflow.controller import transport
from hybridflow.controller.errors import WorkerDiedError
from hybridflow.controller.fork_server import apply_environment, process_context
from hybridflow.controller.resources import ResourcePool
from hybridflow.controller.worker import (
    RankResult,
    WorkerContext,
    WorkerHost,
    destroy_distributed,
    init_distributed,
)


class LocalBackend:
    name = "local"

    def __init__(
        self,
        worker_cls: type,
        pool: ResourcePool,
        group: str,
        init_kwargs: dict,
        start_timeout_s: float,
        collective_timeout_s: float,
        rendezvous_host: str = "127.0.0.1",
    ) -> None:
        """``rendezvous_host``: where rank 0's torch.distributed store listens; the default
        keeps it off the network (all ranks are on this host)."""
        if pool.num_nodes != 1:
            raise ValueError(
                f"the local backend runs on one node; {pool} spans {pool.num_nodes}: use backend='ray'"
            )
        self.group = group
        self.world_size = pool.world_size
        # Names this group's shm segments (unique even when two groups share a name).
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Calls reuse shared memory (transport.segment_pool); replies are mapped once each.
        self.segments = transport.segment_pool(self.owner)
        self.reader = transport.segment_reader()
        self.closing = False
        self.dead: dict[int, str] = {}
        self.pending: list[dict[int, Future]] = [{} for _ in range(self.world_size)]
        self.lock = threading.Lock()
        self.call_ids = itertools.count()
        ctx = process_context()
        port = _free_port()
        self.procs, self.conns = [], []
        for rank in range(self.world_size):
            context = WorkerContext(
                rank,
                self.world_size,
                rank,
                self.world_size,
                pool.device_for(rank),
                group,
                self.name,
            )
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    child_end,
                    context,
                    port,
                    collective_timeout_s,
                    os.getpid(),
                    rendezvous_host,
                    dict(os.environ),  # a forked worker would have the fork server's
                ),
                name=f"hybridflow-{group}-{rank}",
                daemon=False,  # workers may start their own children (daemons cannot)
            )
            proc.start()
            child_end.close()  # so that the pipe reports EOF when the worker dies
            self.procs.append(proc)
            self.conns.append(parent_end)
        try:
            for conn in self.conns:
                conn.send_bytes(transport.encode((worker_cls, init_kwargs), self.owner))
            self.start_outcomes = self._wait_ready(start_timeout_s)
        except BaseException:  # e.g. Ctrl-C while starting, or an unpicklable init kwarg
            self.shutdown()
            raise
        if any(o.error for o in self.start_outcomes):
            return  # the group shuts us down; late start replies must not look like results
        for rank in range(self.world_size):
            threading.Thread(
                target=self._read_replies,
                args=(rank,),
                name=f"hybridflow-{group}-reader-{rank}",
                daemon=True,
            ).start()

    def _wait_ready(self, timeout_s: float) -> list[RankResult]:
        """Start outcome of every rank; returns early when one rank fails, since the others
        may be waiting for it in a collective of their ``__init__``."""
        deadline = time.monotonic() + timeout_s
        outcomes: dict[int, RankResult] = {}
        while len(outcomes) < self.world_size:
            for rank, (conn, proc) in enumerate(zip(self.conns, self.procs)):
                if rank in outcomes:
                    continue
                if conn.poll(0.05):
                    try:
                        outcomes[rank] = transport.decode(conn.recv_bytes())
                    except EOFError:
                        proc.join(1)
                        outcomes[rank] = RankResult(
                            error=f"worker process exited with code {proc.exitcode} while starting"
                        )
                elif not proc.is_alive():
                    outcomes[rank] = RankResult(
                        error=f"worker process exited with code {proc.exitcode} while starting"
                    )
                elif time.monotonic() > deadline:
                    outcomes[rank] = RankResult(
                        error=f"worker did not start within {timeout_s:.0f}s"
                    )
                if rank in outcomes and outcomes[rank].error:
                    return [outcomes.get(r, RankResult()) for r in range(self.world_size)]
        return [outcomes[r] for r in range(self.world_size)]

    def submit(self, path: str, per_rank: list[tuple[tuple, dict]]) -> list[Future]:
        futures: list[Future] = [Future() for _ in per_rank]
        with self.lock:  # every rank sees calls in the same order (collectives match up)
            call_id = next(self.call_ids)
            messages, segment = transport.encode_many(
                [(call_id, path, args, kwargs) for args, kwargs in per_rank],
                self.owner,
                pool=self.segments,
            )
            if segment is not None:  # shared by all ranks: unlinked once every rank is done
                _unlink_when_all_done(futures, segment)
            for rank, (future, message) in enumerate(zip(futures, messages)):
                future.path = path  # type: ignore[attr-defined]
                if rank in self.dead:
                    transport.release_unsent(message, self.segments)
                    future.set_exception(self._died(rank, path))
                    continue
                self.pending[rank][call_id] = future
                try:
                    self.conns[rank].send_bytes(message)
                except (OSError, EOFError):
                    transport.release_unsent(message, self.segments)
                    self.pending[rank].pop(call_id, None)
                    self._mark_dead(rank)
                    if not future.done():
                        future.set_exception(self._died(rank, path))
        return futures

    def _read_replies(self, rank: int) -> None:
        conn = self.conns[rank]
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                call_id, outcome = transport.decode(data, self.reader)
            except Exception as exc:  # noqa: BLE001 - e.g. a result class the controller cannot import
                call_id = None  # calls run in order: the reply is the oldest pending call's
                outcome = RankResult(error=f"the controller could not unpickle the result: {exc!r}")
            if call_id is None:  # the worker could not read which call this was
                call_id = min(self.pending[rank], default=None)
            future = self.pending[rank].pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(outcome)
        if not self.closing:
            self._mark_dead(rank)

    def _mark_dead(self, rank: int) -> None:
        proc = self.procs[rank]
        proc.join(0.5)
        self.dead[rank] = f"worker process {proc.pid} exited with code {proc.exitcode}"
        for future in list(self.pending[rank].values()):
            if not future.done():
                future.set_exception(self._died(rank, getattr(future, "path", "?")))
        self.pending[rank].clear()

    def _died(self, rank: int, path: str) -> WorkerDiedError:
        return WorkerDiedError(
            self.group, "", rank, path, self.dead.get(rank, "worker process died")
        )

    def check_alive(self) -> None:
        """Backstop to the pipe EOF: poll the processes themselves."""
        for rank, proc in enumerate(self.procs):
            if rank not in self.dead and not proc.is_alive() and not self.closing:
                self._mark_dead(rank)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self, grace_s: float = 5.0) -> None:
        import psutil

        self.closing = True
        descendants = []
        for proc in self.procs:
            try:
                descendants += psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                pass
        for conn in self.conns:
            try:
                conn.send_bytes(transport.encode(("stop",), self.owner))
            except (OSError, EOFError):
                pass
        outcomes = getattr(self, "start_outcomes", None)  # unset: start-up never finished
        if any(self.pending) or outcomes is None or any(o is None or o.error for o in outcomes):
            grace_s = min(grace_s, 0.5)  # busy or half-built workers will not read "stop" soon
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        for child in descendants:  # e.g. a sandbox a worker started: never left behind
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(descendants, timeout=2)
        for conn in self.conns:
            conn.close()
        self.segments.close()
        transport.remove_segments(self.owner)
        for proc in self.procs:
            transport.remove_segments(str(proc.pid))
        for rank in range(self.world_size):
            for future in self.pending[rank].values():
                if not future.done():
                    future.set_exception(
                        WorkerDiedError(self.group, "", rank, "?", "worker group was shut down")
                    )


def _unlink_when_all_done(futures: list[Future], path: str) -> None:
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    for future in futures:
        future.add_done_callback(one_done)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_main(
    conn,
    context: WorkerContext,
    port: int,
    collective_timeout_s: float,
    controller_pid: int,
    rendezvous_host: str,
    environ: dict[str, str],
) -> None:
    apply_environment(environ)
    # The controller decides when workers stop: a scheduler's SIGTERM to the whole process
    # group must not kill them while the controller saves a checkpoint.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_controller, args=(controller_pid,), daemon=True).start()
    owner = str(os.getpid())
    host = WorkerHost()
    try:
        try:
            worker_cls, init_kwargs = transport.decode(conn.recv_bytes())
            connect = "127.0.0.1" if rendezvous_host in ("0.0.0.0", "::", "") else rendezvous_host
            init_distributed(context, connect, port, collective_timeout_s, rendezvous_host)
        except BaseException as exc:  # noqa: BLE001 - reported to the controller
            import traceback

            conn.send_bytes(
                transport.encode(
                    RankResult(
                        error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
                    ),
                    owner,
                )
            )
            return
        conn.send_bytes(transport.encode(host.start(worker_cls, context, init_kwargs), owner))
        _serve(conn, host, owner, transport.segment_pool(owner), transport.segment_reader())
    finally:
        destroy_distributed()


def _serve(
    conn,
    host: WorkerHost,
    owner: str,
    pool: transport.SegmentPool,
    reader: transport.SegmentReader,
) -> None:
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the controller is gone
        try:
            message = transport.decode(data, reader)
        except Exception as exc:  # noqa: BLE001 - e.g. an argument class this process cannot import
            error = f"the worker could not unpickle the arguments: {exc!r}"
            conn.send_bytes(transport.encode((None, RankResult(error=error)), owner))
            continue
        if message[0] == "stop":
            host.close()  # the worker's shutdown hook; its failure must not keep us alive
            return
        call_id, path, args, kwargs = message
        # Views of the arguments the worker did not keep are freed before the reply, so that
        # the controller finds their segment free at its next call.
        del message, data
        outcome = host.call(path, args, kwargs)
        del args, kwargs
        try:
            [reply], _ = transport.encode_many(
                [(call_id, outcome)], owner, receiver_unlinks=True, pool=pool
            )
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            reply = transport.encode(
                (call_id, RankResult(error=f"{path} returned a value that cannot be sent: {exc}")),
                owner,
            )
        conn.send_bytes(reply)


def _exit_with_controller(controller_pid: int) -> None:
    """If the controller is SIGKILLed no atexit runs: workers notice and leave on their own.

    The controller is not this process's parent when the fork server started it, so this
    waits on what ends with the controller itself: multiprocessing's parent sentinel (a pipe
    whose write end only the controller holds) and, where Linux has pidfds, the controller's
    process (in case a child the controller forked holds a copy of that pipe)."""
    watched = [multiprocessing.parent_process().sentinel]
    try:
        watched.append(os.pidfd_open(controller_pid))
    except (AttributeError, OSError):  # no pidfd here, or the controller is already gone
        pass
    multiprocessing.connection.wait(watched)
    try:
        _kill_descendants()
    finally:
        os._exit(1)


def _kill_descendants() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
