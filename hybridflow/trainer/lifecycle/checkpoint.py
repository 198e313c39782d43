"""Checkpoint directories that are either complete or ignored, never half-written.

Layout under `root` (usually `<trainer.run_dir>/checkpoints`):

    step_20/               a complete checkpoint: whatever the writer put there, plus
      metadata.json        {"step": 20, "saved_at": ..., "files": {path: bytes}, ...caller's}
      COMPLETE             written last; its presence is what "complete" means
    .tmp-step_30/          a save in progress (or killed mid-way): ignored, removed later

`save` lets the writer fill `.tmp-step_N`, writes the metadata and the marker, fsyncs, and
renames the directory to `step_N` (a rename within one file system is atomic). A process
killed at any point leaves the previous complete checkpoint as `latest()`. A save that fails
(a full disk) removes its temporary directory, so the space is free for the rerun.

`prepare` and `complete` are the two halves of `save`, for a checkpoint whose files are
written while training goes on (trainer/lifecycle/pending_save.py): the marker and the rename still
come only after every file is on disk, and pruning only after the rename.

`metadata.json` lists every file with its size: `damage(path)` (checkpoint_files.py) finds a
checkpoint whose files were truncated or deleted afterwards, or that holds a link, and
resuming falls back to an older one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.config import ConfigError
from hybridflow.errors import UserError, is_disk_full
from hybridflow.trainer.lifecycle.checkpoint_files import (
    METADATA_FILE,
    checksums,
    damage,
    file_sizes,
)

COMPLETE_MARKER = "COMPLETE"
RNG_FILE = "rng_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def read_metadata(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / METADATA_FILE).read_text())


def _fsync_tree(path: Path) -> None:
    """Flush file contents and directory entries so the marker never outlives the data."""
    for directory, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(directory, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(directory))


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class CheckpointManager:
    """Atomic `step_N` checkpoints under `root`, keeping the newest `keep_last_k`."""

    def __init__(self, root: str | Path, keep_last_k: int | None = 2):
        if keep_last_k is not None and keep_last_k < 1:
            raise ConfigError(
                [f"trainer.keep_last_k={keep_last_k} must be >= 1 (or None: keep all)"]
            )
        self.root = Path(root)
        self.keep_last_k = keep_last_k
        # The newest checkpoint known good: the one resumed from (its files verified) or
        # the last one saved. Pruning never deletes it, even when newer ones (damaged ones,
        # or ones of a run resumed from further back) fill keep_last_k.
        self.verified: Path | None = None

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def save(
        self,
        step: int,
        writer_fn: Callable[[Path], None],
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """Run `writer_fn(tmp_dir)`, then publish the directory as `step_N` atomically."""
        return self.complete(step, self.prepare(step), writer_fn, metadata)

    def prepare(self, step: int) -> Path:
        """A fresh, empty `.tmp-step_N` for the writers (the first half of :meth:`save`)."""
        self.root.mkdir(parents=True, exist_ok=True)
        temporary = self.root / f".tmp-step_{step}"
        if temporary.exists():  # left by a killed save of the same step
            shutil.rmtree(temporary)
        temporary.mkdir()
        return temporary

    def complete(
        self,
        step: int,
        temporary: Path,
        writer_fn: Callable[[Path], None],
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """Run `writer_fn(temporary)`, write the metadata and the marker, fsync, rename to
        `step_N`, prune. Any failure removes `temporary` (see :meth:`abandon`)."""
        try:
            writer_fn(temporary)
            info = {"step": step, "saved_at": time.time(), **(metadata or {})}
            info["files"] = file_sizes(temporary)
            # read back from the page cache; on the save's thread (a background one with
            # trainer.async_save)
            info["checksums"] = checksums(temporary, info["files"])
            (temporary / METADATA_FILE).write_text(json.dumps(info, indent=2, default=str))
            _fsync_tree(temporary)  # every file on disk before the marker says so
            _write_synced(temporary / COMPLETE_MARKER, f"{step}\n")
            _fsync_dir(temporary)
        except BaseException as error:
            self.abandon(step, temporary, error)
            raise
        final = self.step_dir(step)
        if final.exists():  # re-saving a step (e.g. after resuming from an older one)
            stale = self.root / f".old-step_{step}"
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(final, stale)
            os.rename(temporary, final)
            shutil.rmtree(stale)
        else:
            os.rename(temporary, final)
        _fsync_dir(self.root)
        self.verified = final  # its checksums were just read from the files on disk
        self._prune()
        return final

    def abandon(self, step: int, temporary: Path, error: BaseException) -> None:
        """Remove a failed save's `temporary` (a full disk must not stay full); raises a
        UserError saying so when the disk is full, else returns for the caller to re-raise."""
        full = isinstance(error, Exception) and is_disk_full(error, self.root)
        shutil.rmtree(temporary, ignore_errors=True)
        if full:
            raise UserError(
                f"no space left at {self.root} while saving the checkpoint of step {step}; "
                f"the partial checkpoint was removed and the older ones are kept",
                "free some space (or lower trainer.keep_last_k, or move trainer.run_dir) "
                "and run the same command again: it resumes from the last complete one",
            ) from error

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """`(step, path)` of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir() and is_complete(path):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint; temporary and incomplete directories are ignored."""
        complete = self.complete_checkpoints()
        return complete[-1][1] if complete else None

    def latest_step(self) -> int | None:
        complete = self.complete_checkpoints()
        return complete[-1][0] if complete else None

    def resume_candidates(self, resume: str | None) -> list[Path]:
        """Checkpoints to try, best first: "auto" -> every complete one, newest first;
        "disable" -> none; a path -> that one (it must be complete)."""
        if resume in (None, "", "disable", "none"):
            return []
        if resume == "auto":
            return [path for _, path in reversed(self.complete_checkpoints())]
        path = Path(resume)
        if not is_complete(path):
            raise UserError(
                f"trainer.resume={resume!r}: not a complete checkpoint (no {COMPLETE_MARKER} "
                f"marker)",
                f"use trainer.resume=auto to pick the latest complete one in {self.root}",
            )
        return [path]

    def remove_stale(self) -> None:
        """Delete what killed saves left (`.tmp-step_*`): on a full disk, the rerun needs it."""
        if self.root.is_dir():
            for path in [*self.root.glob(".tmp-step_*"), *self.root.glob(".old-step_*")]:
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        """Delete all but the newest `keep_last_k` complete checkpoints (never the newest one
        known good, :attr:`verified`) and stale temps."""
        for path in self.root.glob(".tmp-step_*"):
            shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob(".old-step_*"):
            shutil.rmtree(path, ignore_errors=True)
        complete = self.complete_checkpoints()
        if self.keep_last_k is None:
            return
        for _, path in complete[: -self.keep_last_k]:
            if path == self.verified:
                continue
            # Drop the marker first: a crash mid-delete leaves an ignored directory.
            (path / COMPLETE_MARKER).unlink()
            shutil.rmtree(path)


def load_newest_intact(
    manager: CheckpointManager,
    resume: str | None,
    load: Callable[[Path], None],
    log: Callable[[str], None],
    check: Callable[[Path], None] | None = None,
) -> Path | None:
    """Load the checkpoint ``resume`` names (see :meth:`CheckpointManager.resume_candidates`)
    with ``load(path)``. With "auto", one whose files are damaged (:func:`damage`: links,
    sizes, checksums) or that the loader refuses (a UserError) is skipped with a message and
    the previous one is tried. ``check(path)`` runs first and its refusal stops the search.
    The loaded checkpoint becomes ``manager.verified``; None when there is none."""
    from hybridflow.errors import as_user_error
    from hybridflow.trainer.lifecycle.checkpoint_files import has_checksums

    damaged, said_unchecked = [], False
    for path in manager.resume_candidates(resume):
        if check is not None:
            check(path)
        if not has_checksums(path) and not said_unchecked:
            said_unchecked = True
            log(f"{path} was saved by an earlier version, without content checksums: only its "
                "file sizes are checked")  # fmt: skip
        problems = damage(path)
        if not problems:
            try:
                load(path)
                manager.verified = path
                return path
            except Exception as error:  # noqa: BLE001 - a refused or damaged file: try older
                user_error = as_user_error(error)
                if user_error is None:
                    raise
                problems = [str(user_error).split("\n")[0]]
        if resume != "auto":
            raise UserError(
                f"trainer.resume={resume}: checkpoint damaged: {'; '.join(problems)}",
                "use trainer.resume=auto to take the newest intact one",
            )
        damaged.append(path)
        log(f"checkpoint {path} is damaged ({'; '.join(problems)}); trying the previous one")
    if damaged:
        raise UserError(
            f"every checkpoint in {manager.root} is damaged ({', '.join(p.name for p in damaged)})",
            "start over with trainer.resume=disable (or another trainer.run_dir)",
        )
    return None


# torch is imported inside the RNG helpers only, so the manager itself stays light.


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python, numpy, torch (CPU) and every CUDA device if present, as tensors
    and plain Python data (so the file loads with ``weights_only=True``)."""
    import torch

    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),  # uint32 words, widened
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(_as_python_random_state(state["python"]))
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    np.random.set_state(numpy_state)  # a tuple in checkpoints of earlier versions
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_random_state(state):
    """``random.setstate`` wants tuples; a state file may hand back lists."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


def save_rng_state(directory: str | Path, filename: str = RNG_FILE) -> Path:
    import torch

    path = Path(directory) / filename
    torch.save(capture_rng_state(), path)
    return path


def load_rng_state(directory: str | Path, filename: str = RNG_FILE) -> None:
    from hybridflow.state_files import load_state_file

    restore_rng_state(load_state_file(Path(directory) / filename))
