"""Reading checkpoint files without running code from them.

A checkpoint someone sends you is data, not a program: ``torch.load(weights_only=False)``
and plain ``pickle.load`` would run whatever a planted pickle asks for. Our own state files
hold only tensors and plain Python data (numbers, strings, lists, dicts, tuples), so
:func:`load_state_file` reads them with ``weights_only=True``. Files written by earlier
versions held numpy arrays (the RNG state); those three numpy globals — array data, no code —
are allowed too. The model and optimizer shards of ``torch.distributed.checkpoint`` come with
a ``.metadata`` file that torch unpickles without restriction: :func:`read_dcp_metadata`
reads it with an unpickler that accepts only the checkpoint metadata classes, and the shards
themselves load through hybridflow/dcp_reader.py, which reads tensors and plain values only.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from hybridflow.errors import UserError

REFUSED_FIX = (
    "use a checkpoint written by hybridflow itself, or start fresh with trainer.resume=disable"
)

# The globals a ``.metadata`` file of torch.distributed.checkpoint refers to: its own
# dataclasses and the torch values inside them, by exact name. A name with a dot is refused:
# pickle resolves "module" + "os.system" through the module's attributes, so a prefix or
# module-wide allowance would hand out whatever the module imported.
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by name, from a fixed table
    "torch": {"Size"},  # and every dtype (below)
    "pathlib": {"PosixPath", "PurePosixPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath"},  # Python >= 3.13
    "collections": {"OrderedDict"},
}  # fmt: skip


def _numpy_data_globals() -> list:
    """numpy's array reconstruction: builds arrays from bytes and never calls user code
    (object arrays would need further globals, which stay refused)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    dtype_classes = [type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDGSUV"]
    return [_reconstruct, np.ndarray, np.dtype, *dtype_classes]


def to_plain_data(value: Any) -> Any:
    """``value`` with numpy scalars and arrays turned into Python numbers and tensors, tuples
    kept: what :func:`load_state_file` accepts without the numpy allowance."""
    import numpy as np
    import torch

    if isinstance(value, dict):
        return {key: to_plain_data(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain_data(item) for item in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    return value


def load_state_file(path: str | Path) -> Any:
    """``torch.load`` of a state file we wrote, refusing anything that would run code.

    Raises UserError naming the file when it is refused, damaged or missing."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} is missing", REFUSED_FIX)
    try:
        with torch.serialization.safe_globals(_numpy_data_globals()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        detail = str(error).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
        raise UserError(
            f"{path} was not loaded: it holds Python objects other than tensors and plain data "
            f"({detail}); loading it could run code that came with the file",
            REFUSED_FIX,
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise UserError(
            f"{path} is damaged (truncated or not a torch file: {str(error).splitlines()[0]})",
            REFUSED_FIX,
        ) from None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        allowed = name in DCP_METADATA_GLOBALS.get(module, ())
        if module == "torch" and "." not in name:  # torch.float32, torch.bfloat16, ...
            allowed = allowed or isinstance(getattr(torch, name, None), torch.dtype)
        if not allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not checkpoint metadata")
        return super().find_class(module, name)


def read_dcp_metadata(path: str | Path):
    """The ``Metadata`` of a torch.distributed.checkpoint ``.metadata`` file, unpickled with
    nothing but the metadata classes allowed (torch's own reader unpickles it unrestricted).
    Raises UserError naming the file when it is missing, refused or damaged."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    if path.is_symlink() or not path.is_file():
        what = "a link" if path.is_symlink() else "missing"
        raise UserError(f"{path} is {what}: the checkpoint is incomplete", REFUSED_FIX)
    try:
        with path.open("rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as error:
        raise UserError(
            f"{path} was not loaded: {error}; loading it could run code that came with the file",
            REFUSED_FIX,
        ) from None
    except (EOFError, ValueError, AttributeError, TypeError, ImportError, KeyError) as error:
        raise UserError(
            f"{path} is damaged ({type(error).__name__}: {error})", REFUSED_FIX
        ) from None
    if not isinstance(metadata, Metadata):
        raise UserError(
            f"{path} is damaged (it holds a {type(metadata).__name__}, not checkpoint metadata)",
            REFUSED_FIX,
        )
    return metadata


def check_dcp_metadata(directory: str | Path) -> None:
    """Refuse a torch.distributed.checkpoint directory whose ``.metadata`` would run code."""
    read_dcp_metadata(Path(directory) / ".metadata")
