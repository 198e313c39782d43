"""Tensor parallelism of the decoder on DTensor (Megatron-LM's layout, Shoeybi et al. 2019,
arXiv:1909.08053, through torch.distributed.tensor.parallel).

Per layer, q/k/v and gate/up are column-parallel (each rank computes its heads and its slice
of the MLP width) and o_proj and down_proj row-parallel (each rank's partial product is
summed by one all-reduce): two all-reduces per layer forward, two in its backward. The
embedding is split by vocabulary rows (each rank looks up the ids it holds; one all-reduce),
and so is the lm_head, whose log-probs and entropy come from models/sharding/vocab_parallel.py without
a [tokens, vocabulary] tensor on any rank. Norms, RoPE and the residual stream are
replicated. A tied lm_head stays tied (the same vocabulary-split parameter).

The model keeps its parameter names; ``state_dict`` holds DTensors whose ``full_tensor()``
is the Hugging Face weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


def check_tensor_parallel(config, size: int) -> None:
    """ValueError unless ``size`` ranks can each hold whole heads, whole KV heads and an equal
    part of the MLP width and vocabulary (validate() says the same with the config keys)."""
    widths = {
        "attention heads": config.num_attention_heads,
        "KV heads": config.num_key_value_heads,
        "MLP width": config.intermediate_size,
        "vocabulary": config.vocab_size,
    }
    uneven = [f"{name} {value}" for name, value in widths.items() if value % size]
    if uneven:
        raise ValueError(f"tensor parallelism over {size} ranks needs {', '.join(uneven)} "
                         f"to be multiples of {size}")  # fmt: skip
    if config.is_moe:
        raise ValueError("tensor parallelism of mixture-of-experts layers is not built")


def parallelize_decoder(lm: nn.Module, mesh: DeviceMesh) -> None:
    """Shard a CausalLM's layers, embedding and lm_head over the one-dimensional ``mesh`` (in
    place; the weights must be equal on every rank)."""
    check_tensor_parallel(lm.config, mesh.size())
    for layer in lm.model.layers:
        parallelize_module(layer, mesh, {name: style() for name, style in LAYER_PLAN.items()})
    parallelize_module(lm.model.embed_tokens, mesh, RowwiseParallel(input_layouts=Replicate()))
    if lm.config.tie_word_embeddings:
        lm.tie_weights()  # the head reads the vocabulary-split embedding
    else:
        parallelize_module(lm.lm_head, mesh, ColwiseParallel(output_layouts=Shard(-1)))


def vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, dist.ProcessGroup, int] | None:
    """(this rank's rows, the tensor-parallel group, the first row's id) of an lm_head split by
    vocabulary; None for a whole weight."""
    if not isinstance(weight, DTensor):
        return None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements[0] != Shard(0):
        raise ValueError(f"expected an lm_head split by rows over one mesh dimension, got "
                         f"{weight.placements} over {mesh}")  # fmt: skip
    rows = -(-weight.shape[0] // mesh.size())  # DTensor's Shard: ceil-sized chunks
    return weight.to_local(), mesh.get_group(), mesh.get_local_rank() * rows
