"""Checkpoints crafted by someone who knows the format: planted pickles that would create a
marker file when unpickled, DCP metadata rewritten with DCP's own classes, and the size
list of metadata.json made to match again (so the loader itself must refuse them)."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import torch


class Planted:
    """Unpickling this creates ``marker``: the stand-in for any code an attacker wants run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def planted_torch_file(marker: Path) -> bytes:
    """What ``torch.save`` writes for a value whose unpickling runs code."""
    buffer = io.BytesIO()
    torch.save({"value": Planted(marker)}, buffer)
    return buffer.getvalue()


def read_metadata(actor: Path):
    """The DCP metadata of a checkpoint these tests wrote (to be written back crafted)."""
    from hybridflow.state_files import read_dcp_metadata

    return read_dcp_metadata(actor / ".metadata")


def write_metadata(actor: Path, metadata) -> None:
    with open(actor / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


def declare_bytes_item(actor: Path, fqn: str, payload: bytes, file_name: str) -> None:
    """Rewrite ``actor/.metadata`` so that entry ``fqn`` is a BYTES item stored in
    ``file_name`` (relative to ``actor``), and write ``payload`` there. Only DCP's own
    metadata classes are used: the metadata passes any allowlist of classes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = read_metadata(actor)
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo(file_name, 0, len(payload))
    target = actor / file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(payload)
    write_metadata(actor, metadata)


def point_entry_at(actor: Path, fqn_prefix: str, relative_path: str) -> None:
    """Rewrite the storage entries of ``fqn_prefix``* to name ``relative_path``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata = read_metadata(actor)
    for index, info in list(metadata.storage_data.items()):
        if index.fqn.startswith(fqn_prefix):
            metadata.storage_data[index] = _StorageInfo(relative_path, info.offset, info.length)
    write_metadata(actor, metadata)


def reseal(step_dir: Path) -> None:
    """Make metadata.json list the files as they are now (sizes and checksums), as an
    attacker who knows the format would."""
    from hybridflow.trainer.lifecycle.checkpoint_files import checksums, file_sizes

    info = json.loads((step_dir / "metadata.json").read_text())
    files = file_sizes(step_dir)
    info["files"] = {k: v for k, v in files.items() if k not in ("metadata.json", "COMPLETE")}
    info["checksums"] = checksums(step_dir, info["files"])
    (step_dir / "metadata.json").write_text(json.dumps(info))
