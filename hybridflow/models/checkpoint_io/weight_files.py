"""The safetensors files of a Hugging Face model directory, by the names the Hub's writers
give them (a single model.safetensors, or shards listed by model.safetensors.index.json); both
the loader (hf_checkpoint.py) and the checks before it (loadability.py) read this list, and
the writer (hf_writer.py) writes under these names."""

from __future__ import annotations

import json
import os

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str) -> list[str]:
    """Safetensors files of a HF model directory (index order for sharded checkpoints)."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r} (only safetensors checkpoints are read)"
    )
