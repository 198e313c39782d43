"""Tensor parallelism of the decoder on DTensor (Megatron-LM's layout, Shoeybi et al. 2019,
arXiv:1909.08053, through torch.distributed.tensor.parallel).

Per layer, q/k/v and gate/up are column-parallel (each rank computes its heads and its slice
of the MLP width) and o_proj and down_proj row-parallel (each rank's partial product is
summed by one all-reduce): two all-reduces per layer forward, two in its backward. The
embedding is split by vocabulary rows (each rank looks up the ids it holds; one all-reduce),
and so is the lm_head, whose log-probs and entropy come from models/sharding/vocab_parallel.py without
a [tokens, vocabulary] tensor on any rank. Norms, RoPE and the residual stream are
replicated. A tied lm_head stays tied (the same vocabulary-split parameter).

A norm applied to each head with one weight (qk-norm, Gated DeltaNet's output norm) sees only
its rank's heads: its weight's gradient is summed over the group (:func:`summed_grad`).

Gated DeltaNet layers are split by key heads with their value heads (:class:`TensorHeads`):
in_proj_z, in_proj_a, in_proj_b (value heads in order) column-parallel, out_proj
row-parallel, A_log and dt_bias split by heads. in_proj_qkv's and the conv's rows run
[q; k; v] over all heads, so an even split of them is not whole heads: they are held split
(Shard(0), ``full_tensor()`` is the HF weight) and gathered in the forward, each rank taking
the rows of its heads (their gradient is reduce-scattered back): per layer and step one
gather of the [2 Hk Dk + Hv Dv, H] weight instead of an exchange of each token's q/k/v.

The model keeps its parameter names; ``state_dict`` holds DTensors whose ``full_tensor()``
is the Hugging Face weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hybridflow.models.sharding.deltanet_parallel import HeadShape, head_channels
from hybridflow.models.sharding.grad_sum import summed_grad

LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
    "linear_attn.in_proj_z": ColwiseParallel,
    "linear_attn.in_proj_a": ColwiseParallel,
    "linear_attn.in_proj_b": ColwiseParallel,
    "linear_attn.out_proj": RowwiseParallel,
}
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm", "linear_attn.norm")
"""Norms whose one weight is applied to every head (each rank applies it to its own)."""


class TensorHeads:
    """A tensor-parallel rank's heads of a Gated DeltaNet layer: a contiguous 1/size of its
    key heads with their value heads. The layer asks it for its q/k/v projection and its
    per-head weights (models/mixers/gated_deltanet.py)."""

    def __init__(self, shape: HeadShape, mesh: DeviceMesh):
        count = shape.key_heads // mesh.size()
        self.mesh = mesh
        self.channels = head_channels(shape, mesh.get_local_rank() * count, count)

    def _rows(self, weight: DTensor) -> torch.Tensor:
        """This rank's rows of a [q; k; v] weight held as Shard(0): gathered, then taken
        (their gradient, zero elsewhere, is summed over the ranks into each one's shard)."""
        full = weight.full_tensor(grad_placements=[Partial()])
        return full[self.channels.to(full.device)]

    def project_qkv(self, x: torch.Tensor, weight: DTensor) -> torch.Tensor:
        """in_proj_qkv for this rank's heads: x [..., H] (replicated) -> [..., C/size]."""
        return F.linear(summed_grad(x, self.mesh), self._rows(weight))

    def local(self, conv: DTensor, A_log: DTensor, dt_bias: DTensor):
        """(conv taps [C/size, 1, K], A_log, dt_bias [Hv/size]) of this rank's heads."""
        return self._rows(conv), A_log.to_local(), dt_bias.to_local()


def _split_deltanet(mixer: nn.Module, mesh: DeviceMesh) -> None:
    """Hold in_proj_qkv's and the conv's rows, A_log and dt_bias split over ``mesh`` and hand
    the layer its rank's heads (the projections of LAYER_PLAN are split by then)."""
    shape = HeadShape.of(mixer, mixer.in_proj_qkv.weight.shape[0], mixer.num_v_heads)
    for module, name in ((mixer.in_proj_qkv, "weight"), (mixer.conv1d, "weight"),
                         (mixer, "A_log"), (mixer, "dt_bias")):  # fmt: skip
        split = distribute_tensor(getattr(module, name).detach(), mesh, [Shard(0)])
        module.register_parameter(name, nn.Parameter(split))
    mixer.tensor_heads = TensorHeads(shape, mesh)


def check_tensor_parallel(config, size: int) -> None:
    """ValueError unless ``size`` ranks can each hold whole heads, whole KV heads and an equal
    part of the MLP width and vocabulary (validate() says the same with the config keys)."""
    widths = {
        "attention heads": config.num_attention_heads,
        "KV heads": config.num_key_value_heads,
        "Gated DeltaNet key heads": config.linear_num_key_heads,
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
        names = set(dict(layer.named_modules()))
        plan = {name: style() for name, style in LAYER_PLAN.items() if name in names}
        parallelize_module(layer, mesh, plan)
        if layer.spec.recurrent:
            _split_deltanet(layer.linear_attn, mesh)
        for name in HEAD_NORMS:
            if name in names and layer.get_submodule(name) is not None:
                layer.get_submodule(name).grad_mesh = mesh
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
