"""The safetensors files a model directory's index names: a damaged index is named, with
what it lacks, before a weight is read."""

from __future__ import annotations

import json

import pytest

from hybridflow.errors import UserError
from hybridflow.models.checkpoint_io.weight_files import INDEX_FILE, checkpoint_files


def _index(folder, text, shards=("model-1.safetensors",)):
    for name in shards:
        (folder / name).write_bytes(b"")
    (folder / INDEX_FILE).write_text(text if isinstance(text, str) else json.dumps(text))


def test_the_shards_of_the_index_in_its_order_each_once(tmp_path):
    _index(tmp_path, {"weight_map": {"a": "model-2.safetensors", "b": "model-1.safetensors",
                                     "c": "model-2.safetensors"}},
           shards=("model-1.safetensors", "model-2.safetensors"))  # fmt: skip
    assert checkpoint_files(str(tmp_path)) == [
        str(tmp_path / "model-2.safetensors"), str(tmp_path / "model-1.safetensors")
    ]  # fmt: skip


@pytest.mark.parametrize(
    "index, words",
    [
        ("{not json", "cannot be read as JSON"),
        ("[" * 100_000 + "]" * 100_000, "cannot be read as JSON"),
        ({"weight_map": ["a"]}, "needs a weight_map object"),
        ({"weight_map": {"a": 7}}, "needs a weight_map object"),
        ([1], "needs a weight_map object"),
        ({"weight_map": {"a": "../../etc/passwd"}}, "names the shard '../../etc/passwd', not a file name"),
        ({"weight_map": {"a": "model-2.safetensors"}}, "names the shard model-2.safetensors, which is not in"),
    ],
    ids=["not-json", "nested", "map-list", "map-values", "list", "outside", "missing-shard"],
)  # fmt: skip
def test_a_damaged_index_is_named(tmp_path, index, words):
    """Each was a traceback (AttributeError, RecursionError) or a later read of the wrong file."""
    _index(tmp_path, index)
    with pytest.raises(UserError, match="copy the model directory again") as error:
        checkpoint_files(str(tmp_path))
    assert str(error.value).startswith(str(tmp_path / INDEX_FILE)) and words in str(error.value)
