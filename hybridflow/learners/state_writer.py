"""Writing one rank's training state as torch.distributed.checkpoint files, now or on a thread.

A background save first *stages* the state: every tensor is copied to host memory (pinned on
CUDA, so the device-to-host copy runs at full bandwidth) while training waits; then a thread
writes the copy and training goes on (its optimizer steps change the live tensors, not the
copy). The cost is one host copy of this rank's model and optimizer state, made at the first
background save and reused by the later ones (so it is held until the run ends).

Either way each rank writes its tensors with ``WRITE_THREADS`` threads, each to its own file
(``__<rank>_<i>.distcp``, split by size); the ``.metadata`` file lists where every tensor
is, so loading does not depend on how many files there are.

Under torch.distributed the background write coordinates the ranks (plans, metadata) over a
gloo group of its own: collectives on the training group run concurrently on the main thread,
and two threads must never share one group's collective order.
"""

from __future__ import annotations

import copy
import functools
import queue
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WRITE_THREADS = 4
"""Files (and writer threads) per rank and checkpoint."""


def stage_to_host(state: dict[str, Any], reuse: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``state`` (nested dicts/lists of tensors, DTensors and plain values) whose
    tensors are host tensors, pinned when CUDA is in use: those of ``reuse`` (an earlier
    copy of the same layout, see :func:`layout`) when given, else new ones."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    pin = torch.cuda.is_available() and torch.cuda.is_initialized()
    staged = reuse if reuse is not None else _create_cpu_state_dict(state, pin_memory=pin)
    staged = _copy_state_dict(state, staged, non_blocking=pin)
    if pin:
        torch.cuda.synchronize()  # the copies are queued on the stream: the host copy is ready
    return staged


def layout(value: Any) -> Any:
    """Keys, tensor shapes and dtypes of a state dict (plain values by type only): two
    states of the same layout can share one host copy."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, dict):
        return tuple((key, layout(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(layout(item) for item in value)
    return type(value).__name__


class StateWriter:
    """Writes a rank's state dict and its small ``extra`` file; at most one write pending."""

    def __init__(self, process_group: dist.ProcessGroup | None, distributed: bool) -> None:
        self.process_group = process_group
        self.distributed = distributed
        self._background_group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._directory: Path | None = None
        # The last host copy, reused by the next save of the same layout: filling freshly
        # allocated host memory costs page faults (3 GiB: 8.5 s on a 2-core CPU VM, 0.3 s into
        # memory already touched), and on CUDA the pinned blocks stay allocated anyway.
        self._staging: tuple[Any, dict[str, Any]] | None = None

    def write(
        self,
        state: dict[str, Any],
        directory: Path,
        extra: dict[str, Any],
        extra_path: Path,
        *,
        background: bool,
    ) -> None:
        """Write ``state`` (DCP) and ``extra`` (torch.save) under ``directory``. background:
        stage to host now, write on a thread (see :meth:`finished`); all ranks must call."""
        self.wait()  # the previous write owns its files until it ends
        if not self.distributed:
            hide_single_process_warning()
        if not background:
            _write_files(state, directory, extra, extra_path, self.process_group, self.distributed)
            return
        staged = self._stage(state)
        extra = copy.deepcopy(extra)  # e.g. the scheduler's lists, which training updates
        group = self._group_for_background()
        self._error, self._directory = None, directory

        def run() -> None:
            try:
                _write_files(staged, directory, extra, extra_path, group, self.distributed)
            except BaseException as error:  # noqa: BLE001 - reported by finished()/wait()
                self._error = error

        self._thread = threading.Thread(target=run, name=f"write-{directory}", daemon=True)
        self._thread.start()

    def finished(self) -> bool:
        """Whether the pending write (if any) is done; raises the error it failed with."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing {self._directory} failed: {error}") from error
        return True

    def wait(self) -> None:
        """Block until the pending write is done; raises its error."""
        if self._thread is not None:
            self._thread.join()
        self.finished()

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        state_layout = layout(state)
        reuse = None
        if self._staging is not None and self._staging[0] == state_layout:
            reuse = self._staging[1]
        self._staging = None  # a new layout: the old copy is freed before the new one is made
        staged = stage_to_host(state, reuse)
        self._staging = (state_layout, staged)
        return staged

    def _group_for_background(self) -> dist.ProcessGroup | None:
        if not self.distributed:
            return None
        if self._background_group is None:  # every rank gets here in the same save call
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            self._background_group = dist.new_group(ranks=ranks, backend="gloo")
        return self._background_group


def hide_single_process_warning() -> None:
    """From now on, in this process, hide torch's warning that a one-process save is
    one-process. ``dcp.save`` warns on every call of a run without torch.distributed, even
    when told ``no_dist=True``, so no argument avoids it, and it asks nothing of the user
    (a reported run hides it too: ``progress.HIDDEN_WARNINGS``). Process-wide rather than ``warnings.catch_warnings``
    around the save: a background save runs on a thread, and catch_warnings there would
    restore the filters over any the main thread set meanwhile. Called on the saving thread
    before the writer thread starts."""
    from hybridflow.dcp_reader import SINGLE_PROCESS_WARNING

    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning)


def _write_files(state, directory: Path, extra, extra_path: Path, group, distributed) -> None:
    import torch.distributed.checkpoint as dcp

    writer = _writer_class()(str(directory), thread_count=WRITE_THREADS)
    dcp.save(state, storage_writer=writer, process_group=group, no_dist=not distributed)
    torch.save(extra, extra_path)


@functools.cache
def _writer_class() -> type:
    """dcp's FileSystemWriter, but its writer threads hand their errors to the save.

    torch's (2.13) writes with ``thread_count - 1`` helper threads besides the caller and
    lets a helper's error escape its thread: Python prints its traceback (a full disk
    printed one per thread and rank before the one message that says what to do) and the
    save goes on without that thread's files. Here every thread's error is kept, all are
    joined, and the first error is raised from the save, which the checkpoint manager reports
    once (a full disk: errors.is_disk_full) and cleans up after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _write_files_from_queue

    class ReportingFileSystemWriter(dcp.FileSystemWriter):
        def _write_data(self, planner, file_queue: queue.Queue) -> torch.futures.Future:
            result_queue: queue.Queue = queue.Queue()
            errors: list[BaseException] = []

            def write() -> None:
                try:
                    _write_files_from_queue(
                        create_stream=self.fs.create_stream,
                        file_queue=file_queue,
                        result_queue=result_queue,
                        planner=planner,
                        transforms=self.transforms,
                        inflight_threshhold=self.per_thread_copy_ahead,
                        use_fsync=self.sync_files,
                        thread_count=self.thread_count,
                        serialization_format=self.serialization_format,
                    )
                except BaseException as error:  # noqa: BLE001 - raised below, on the caller
                    errors.append(error)

            helpers = [threading.Thread(target=write, name=f"dcp-write-{i}", daemon=True)
                       for i in range(1, self.thread_count)]  # fmt: skip
            for helper in helpers:
                helper.start()
            write()
            for helper in helpers:
                helper.join()
            if errors:
                raise errors[0]
            results = []
            while not result_queue.empty():
                results += result_queue.get_nowait()
            written: torch.futures.Future = torch.futures.Future()
            written.set_result(results)
            return written

    return ReportingFileSystemWriter
