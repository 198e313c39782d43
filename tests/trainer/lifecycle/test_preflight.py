"""The model directory checks before a run: the weight files a load reads, as it reads them."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from hybridflow.models.presets import preset_config
from hybridflow.trainer.lifecycle.preflight import checkpoint_problems


def _model_dir(path):
    (path / "config.json").write_text(json.dumps(preset_config("tiny").to_hf()))
    return path


def test_an_index_naming_a_missing_shard_is_named(tmp_path):
    """validate said config OK; the load then failed on the missing file."""
    model = _model_dir(tmp_path)
    save_file({"a": torch.zeros(2)}, str(model / "model-00001-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (problem,) = checkpoint_problems("model.path", str(model))
    assert (
        problem.startswith("model.path: ")
        and "model-00002-of-00002.safetensors, which is not in" in problem
    )


def test_shards_without_their_index_are_named(tmp_path):
    """The loader reads model.safetensors or the index's shards, nothing else."""
    model = _model_dir(tmp_path)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        save_file({"a": torch.zeros(2)}, str(model / name))
    (problem,) = checkpoint_problems("model.path", str(model))
    assert (
        "no model.safetensors (or sharded *.safetensors with model.safetensors.index.json)"
        in problem
    )
