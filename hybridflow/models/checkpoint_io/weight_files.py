"""The safetensors files of a Hugging Face model directory, by the names the Hub's writers
give them (a single model.safetensors, or shards listed by model.safetensors.index.json); both
the loader (hf_checkpoint.py) and the checks before it (loadability.py) read this list, and
the writer (hf_writer.py) writes under these names."""

from __future__ import annotations

import json
import os

from hybridflow.errors import UserError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str) -> list[str]:
    """Safetensors files of a HF model directory (index order for sharded checkpoints).
    UserError naming the index when it does not parse, or names a shard that is not a file
    of the directory; FileNotFoundError when there are no weights."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        return [os.path.join(path, name) for name in _index_shards(index_path)]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r} (only safetensors checkpoints are read)"
    )


def _index_shards(index_path: str) -> list[str]:
    """The shard file names ``index_path``'s weight_map names, each once, in its order."""
    fix = "copy the model directory again (the index and its shards come together)"
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deep
        raise UserError(f"{index_path} cannot be read as JSON ({str(error)[:200]})", fix) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) for name in weight_map.values()
    ):
        raise UserError(f"{index_path} needs a weight_map object of tensor name -> shard file", fix)
    shards = list(dict.fromkeys(weight_map.values()))
    folder = os.path.dirname(index_path)
    for name in shards:
        if os.path.basename(name) != name or name in ("", ".", ".."):  # only the directory's own
            raise UserError(f"{index_path} names the shard {name!r}, not a file name", fix)
        if not os.path.isfile(os.path.join(folder, name)):
            raise UserError(f"{index_path} names the shard {name}, which is not in {folder}", fix)
    return shards
