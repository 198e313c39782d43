"""Tensor names, shapes and dtypes from the safetensors headers of a model directory, without
reading a weight (no torch): what the config checks and the loadability checks compare."""

from __future__ import annotations

import json
from pathlib import Path


def stored_shapes(
    model_dir: str | Path, files: list[str | Path] | None = None
) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from the safetensors headers of ``model_dir`` (no weights read),
    or of ``files`` (those a loader reads); None when a header cannot be read."""
    entries = _header_entries(model_dir, files)
    if entries is None:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for name, info in entries.items():
        shape = info.get("shape", [])
        if not (isinstance(shape, list) and all(_is_size(n) for n in shape)):
            return None  # a damaged header: the file checks name it
        shapes[name] = tuple(shape)
    return shapes


def stored_dtypes(
    model_dir: str | Path, files: list[str | Path] | None = None
) -> dict[str, str] | None:
    """Tensor name -> dtype as the header spells it ("BF16", "F32", "U8", "I64", ...), of
    ``model_dir`` or of ``files``; None when a header cannot be read."""
    entries = _header_entries(model_dir, files)
    if entries is None:
        return None
    return {name: str(info.get("dtype")) for name, info in entries.items()}


def _header_entries(
    model_dir: str | Path, files: list[str | Path] | None
) -> dict[str, dict] | None:
    """Tensor name -> its header entry, over every file; None when a header cannot be read."""
    entries: dict[str, dict] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")) if files is None else files:
        try:
            with open(file, "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(length))
        except (OSError, ValueError, UnicodeDecodeError, MemoryError, RecursionError):
            return None
        if not isinstance(header, dict):
            return None
        entries.update(
            (name, info)
            for name, info in header.items()
            if name != "__metadata__" and isinstance(info, dict)
        )
    return entries


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
