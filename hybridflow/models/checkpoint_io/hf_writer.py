"""Write our decoder as a Hugging Face checkpoint: config.json + safetensors (single, or
sharded with an index), in the family's on-disk names. It needs no model class, so the
decoder's save_pretrained calls it without a circle through the reader."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from hybridflow.models.checkpoint_io import expert_checkpoint
from hybridflow.models.checkpoint_io.weight_files import INDEX_FILE, SINGLE_FILE
from hybridflow.models.families import write_tensors


def save_model(model, directory: str, max_shard_size: int = 5 * 1024**3) -> None:
    """config.json + safetensors in HF layout; shards with an index above max_shard_size bytes.

    Tied lm_head.weight is not written (HF convention)."""
    os.makedirs(directory, exist_ok=True)
    hf_config = model.config.to_hf()
    hf_config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    if getattr(model, "num_labels", None) is not None:  # a reward model: transformers' names
        family = hf_config["architectures"][0].removesuffix("ForCausalLM")
        hf_config["architectures"] = [f"{family}ForSequenceClassification"]
        hf_config["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    state = {
        name: tensor.detach().contiguous().cpu()
        for name, tensor in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    state = dict(write_tensors(model.config, state))
    state = dict(expert_checkpoint.checkpoint_tensors(model.config.model_type, state))
    shards = _split_into_shards(state, max_shard_size)
    for stale in (SINGLE_FILE, INDEX_FILE):
        if os.path.exists(os.path.join(directory, stale)):
            os.remove(os.path.join(directory, stale))
    if len(shards) == 1:
        _save_shard(shards[0], os.path.join(directory, SINGLE_FILE))
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_shard(shard, os.path.join(directory, file_name))
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _save_shard(tensors: dict[str, torch.Tensor], path: str) -> None:
    """One safetensors file, readable as the config.json beside it is: safetensors writes it
    atomically through a private temporary file (mode 0600), kept after the rename."""
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask (read without changing it where /proc says it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting, then set back at once
    os.umask(mask)
    return mask


def _split_into_shards(
    state: dict[str, torch.Tensor], max_shard_size: int
) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    current = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and current + size > max_shard_size:
            shards.append({})
            current = 0
        shards[-1][name] = tensor
        current += size
    return shards
