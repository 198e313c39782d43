"""Expert tensors between the two layouts Hugging Face checkpoints use and our packed one.

In memory (ours and transformers 5's): ``model.layers.{l}.mlp.experts.gate_up_proj [E, 2I, H]``
and ``...down_proj [E, H, I]``, router ``model.layers.{l}.mlp.gate.weight``.
On disk, transformers 5.24's ``save_pretrained`` still writes one tensor per expert, named as
each family always did (and the published checkpoints are):

    qwen3_moe  model.layers.{l}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight
    mixtral    model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight  (gate, up, down)
               model.layers.{l}.block_sparse_moe.gate.weight

Both that layout and the packed names are read; the per-expert one is written.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from hybridflow.models.families import PER_EXPERT_NAMES

_PROJECTION_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                    "w1": "gate", "w3": "up", "w2": "down"}  # fmt: skip
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
_MIXTRAL_MODULE = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.")


def memory_name(name: str) -> tuple[str, int | None, str | None]:
    """A checkpoint tensor name -> (in-memory name, expert, part).

    expert/part ("gate", "up", "down") are set for one expert's slice of a packed tensor,
    None for a tensor that is stored whole (router, packed experts, everything else)."""
    match = _PER_EXPERT.match(name)
    if match and match.group(3) in _PROJECTION_PART:
        layer, expert, projection = match.groups()
        part = _PROJECTION_PART[projection]
        packed = "down_proj" if part == "down" else "gate_up_proj"
        return f"{layer}.mlp.experts.{packed}", int(expert), part
    return _MIXTRAL_MODULE.sub(r"\1.mlp.", name), None, None


def place_expert_slice(packed: torch.Tensor, expert: int, part: str, tensor: torch.Tensor) -> None:
    """Copy one expert's projection [out, in] into its rows of the packed tensor."""
    if part == "down":
        target = packed[expert]
    else:
        inner = packed.shape[1] // 2
        target = packed[expert, :inner] if part == "gate" else packed[expert, inner:]
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"expert {expert} {part} projection has shape {tuple(tensor.shape)}, the model "
            f"expects {tuple(target.shape)} (config.json and weights disagree)"
        )
    target.copy_(tensor)


def expert_slices_expected(packed_names: list[str], num_experts: int) -> set[tuple[str, int, str]]:
    """Every (packed name, expert, part) a per-expert checkpoint must provide."""
    expected = set()
    for name in packed_names:
        parts = ("down",) if name.endswith("down_proj") else ("gate", "up")
        expected |= {(name, e, part) for e in range(num_experts) for part in parts}
    return expected


def checkpoint_tensors(
    model_type: str, state: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """In-memory state -> the names and tensors written to disk (per-expert layout).

    Each slice is cloned: safetensors refuses tensors that share storage."""
    if model_type not in PER_EXPERT_NAMES:
        yield from state.items()
        return
    module, projections = PER_EXPERT_NAMES[model_type]
    for name, tensor in state.items():
        layer_prefix, _, rest = name.partition(".mlp.")
        if not rest:
            yield name, tensor
        elif rest == "gate.weight":
            yield f"{layer_prefix}.{module}.gate.weight", tensor
        elif rest == "experts.gate_up_proj":
            inner = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                base = f"{layer_prefix}.{module}.experts.{e}"
                yield f"{base}.{projections['gate']}.weight", tensor[e, :inner].clone()
                yield f"{base}.{projections['up']}.weight", tensor[e, inner:].clone()
        elif rest == "experts.down_proj":
            for e in range(tensor.shape[0]):
                base = f"{layer_prefix}.{module}.experts.{e}"
                yield f"{base}.{projections['down']}.weight", tensor[e].clone()
        else:  # a dense layer's MLP among the sparse ones
            yield name, tensor


def shapes_in_memory(stored: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as the in-memory names and packed shapes they load
    into (for checks that read safetensors headers only). A per-expert slice [out, in] makes
    gate_up_proj [E, 2*out, in] or down_proj [E, out, in], E = the highest expert index + 1."""
    shapes: dict[str, tuple[int, ...]] = {}
    slices: dict[str, tuple[int, tuple[int, ...]]] = {}  # packed name -> (experts, slice shape)
    for name, shape in stored.items():
        target, expert, _ = memory_name(name)
        if expert is None:
            shapes[target] = tuple(shape)
        else:
            experts, _ = slices.get(target, (0, shape))
            slices[target] = (max(experts, expert + 1), tuple(shape))
    for target, (experts, (out, inner)) in slices.items():
        rows = out if target.endswith("down_proj") else 2 * out
        shapes[target] = (experts, rows, inner)
    return shapes
