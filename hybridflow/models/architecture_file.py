"""A model directory's ModelArchitecture, read from its config.json once per version of the
file: ``validate`` and the memory plan ask for it for each of the thousands of candidate
layouts ``config plan`` judges (trainer/plan/parallel_choice.py), and parsing and checking
the file each time was most of the search's cost for a model directory."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from hybridflow.models.architecture import ModelArchitecture

CACHED_FILES = 16
"""config.json files kept parsed (least recently used first out)."""


def directory_architecture(path: str | Path) -> ModelArchitecture:
    """``ModelArchitecture.from_hf`` of ``<path>/config.json``: the same object as long as the
    file keeps its modification time and size (an edited file is read again), as a preset is
    one shared object; do not change it. Raises what reading and ``from_hf`` raise."""
    file = Path(path) / "config.json"
    stat = file.stat()
    return _read(str(file), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=CACHED_FILES)
def _read(file: str, mtime_ns: int, size: int) -> ModelArchitecture:
    return ModelArchitecture.from_hf(json.loads(Path(file).read_text()))
