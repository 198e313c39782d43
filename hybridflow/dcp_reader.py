"""Loading torch.distributed.checkpoint (DCP) shards as data: tensors and plain values only.

DCP's own loader trusts its files. Its ``.metadata`` may declare any entry a "bytes" item,
which the default planner reads with ``torch.load(weights_only=False)``: a checkpoint that
declares a weight as bytes runs whatever pickle comes with it. And each entry names the file
that holds it by a relative path, which may lead out of the checkpoint (``../``).

:func:`load_state` loads through a reader and a planner of ours instead:

- the ``.metadata`` is unpickled with the metadata classes only (state_files.py);
- every storage entry must name a regular file directly inside the checkpoint directory
  (no ``/``, no ``..``, no link) and no stream transform (hybridflow never writes one);
- an entry this process holds as a tensor must be stored as a tensor: a bytes item there is
  refused before anything is read;
- the bytes items DCP does write (the optimizer's hyperparameters: lr, betas, ...) are read
  with ``torch.load(weights_only=True)``, which builds plain values and tensors, never code.

Every refusal and every damaged file is a UserError naming the file.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from hybridflow.errors import UserError
from hybridflow.state_files import REFUSED_FIX, read_dcp_metadata

METADATA_FILE = ".metadata"

# DCP warns on every load of a one-process run, even when told no_dist=True: it is how such
# a run is meant to load, and `hybridflow export` would print it to every user.
SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized"


class Refused(Exception):
    """An item the planner will not load; the reader adds the file's name."""


def load_state(
    state: dict[str, Any],
    directory: str | Path,
    process_group: dist.ProcessGroup | None = None,
    *,
    distributed: bool = False,
) -> None:
    """``dcp.load(state, ...)`` of the checkpoint at ``directory``, in place, tensors and
    plain values only (see the module docstring). Raises UserError naming the file that was
    refused or damaged."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    # read here, not inside dcp.load: DCP logs a read error with its traceback and retries
    metadata = read_dcp_metadata(directory / METADATA_FILE)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
            dcp.load(
                state,
                storage_reader=TensorReader(directory, metadata),
                planner=TensorPlanner(directory),
                process_group=process_group,
                no_dist=not distributed,
            )
    except CheckpointException as error:  # DCP wraps what each rank raised
        raise _as_user_error(error, directory) from None


def _as_user_error(error: CheckpointException, directory: Path) -> BaseException:
    """The first rank's error: a UserError as it is; any other error of planning the load
    (metadata that does not fit this model: shapes, missing entries, malformed tables) as a
    UserError naming the metadata; a KeyboardInterrupt or the like unchanged."""
    for failure, _ in error.failures.values():
        if isinstance(failure, UserError):
            return failure
    failure = next(iter(error.failures.values()))[0]
    if isinstance(failure, Exception):
        first_line = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
        return UserError(
            f"{directory / METADATA_FILE} does not describe this model's state "
            f"({type(failure).__name__}: {first_line}): the checkpoint is damaged or was "
            "written for another model",
            REFUSED_FIX,
        )
    return failure


def storage_problem(directory: Path, fqn: str, info: Any) -> str | None:
    """What is wrong with the storage entry of ``fqn`` (a ``_StorageInfo``), or None."""
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or not name:
        return f"the entry of {fqn} names no file"
    if "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        return f"the entry of {fqn} names {name!r}, not a file directly inside the checkpoint directory"
    path = directory / name
    if path.is_symlink():
        return f"the entry of {fqn} names {name}, a link (links are refused)"
    if not path.is_file():
        return f"the entry of {fqn} names {name}, which is missing"
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not all(isinstance(v, int) and v >= 0 for v in (offset, length)):
        return f"the entry of {fqn} has offset {offset!r} and length {length!r}"
    if getattr(info, "transform_descriptors", None):
        return f"the entry of {fqn} asks for stream transforms {info.transform_descriptors}"
    return None


class TensorReader(FileSystemReader):
    """A FileSystemReader of ``metadata`` (read by :func:`read_dcp_metadata`) whose entries
    must name regular files inside the directory, and whose errors name the file."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__(str(directory))
        self.directory, self.metadata = Path(directory), metadata

    def read_metadata(self) -> Metadata:  # no rank argument: DCP then never tries rank files
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if not isinstance(self.storage_data, dict):
            raise UserError(f"{self.directory / METADATA_FILE} is damaged (no storage table)")
        for index, info in self.storage_data.items():
            problem = storage_problem(self.directory, getattr(index, "fqn", "?"), info)
            if problem is not None:
                raise UserError(
                    f"{self.directory / METADATA_FILE} was not loaded: {problem}", REFUSED_FIX
                )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            path = self.directory / name
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except UserError:
                raise
            except Refused as refusal:
                raise UserError(f"{path} was not loaded: {refusal}", REFUSED_FIX) from None
            except Exception as error:  # noqa: BLE001 - a torch or OS error reading this file
                detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
                raise UserError(
                    f"{path} is damaged ({type(error).__name__}: {detail})", REFUSED_FIX
                ) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class TensorPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses a bytes item where the state holds a tensor and reads
    the other bytes items (plain values) with the weights-only unpickler."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = Path(directory)

    def create_local_plan(self) -> LoadPlan:
        self._check_tensor_entries()
        plan = super().create_local_plan()
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO and isinstance(
                self.state_dict.get(item.dest_index.fqn), torch.Tensor
            ):
                raise UserError(
                    f"{self.directory / METADATA_FILE} was not loaded: it declares the tensor "
                    f"{item.dest_index.fqn} as a pickled bytes item, and unpickling it could "
                    "run code that came with the checkpoint",
                    REFUSED_FIX,
                )
        return plan

    def _check_tensor_entries(self) -> None:
        """Each tensor this process holds must be stored whole: as a tensor entry whose
        chunks add up to its size (no chunks would leave it silently as initialised)."""
        stored = self.metadata.state_dict_metadata
        for fqn, value in self.state_dict.items():
            entry = stored.get(fqn) if isinstance(stored, dict) else None
            if not isinstance(value, torch.Tensor) or not isinstance(entry, TensorStorageMetadata):
                continue  # bytes entries are refused below; missing ones by DCP
            covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
            if covered != value.numel():
                raise UserError(
                    f"{self.directory / METADATA_FILE} was not loaded: its chunks of {fqn} "
                    f"hold {covered} of its {value.numel()} elements",
                    REFUSED_FIX,
                )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as error:  # a global beyond plain values and tensors
            detail = str(error).split("WeightsUnpickler error:")[-1].strip().splitlines()
            raise Refused(
                f"its item {fqn} holds Python objects other than plain values "
                f"({detail[0] if detail else type(error).__name__}); loading it could run "
                "code that came with the file"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
