"""The tensor-parallel engine model: each rank of a tensor-parallel group holds a slice of
every layer, Megatron's split (Shoeybi et al. 2019, §3):

- q/k/v and gate/up are column-parallel: each rank owns whole attention heads (and their KV
  heads, so the KV cache is sharded by heads) and a slice of the MLP width; no communication;
- o_proj and down_proj are row-parallel: each rank multiplies its slice and one all-reduce
  sums the partial outputs, so one all-reduce per attention and one per MLP;
- the embedding and lm_head are vocab-parallel: each rank owns V / tp rows; a token's
  embedding comes from the rank that owns it (the others add zeros, so the all-reduce is
  exact) and the logits are all-gathered, so every rank samples from the same [B, V] bytes
  with the same seeds and draws the same tokens.

A mixture-of-experts model's sparse layers follow vLLM's expert parallelism inside the
tensor-parallel group: the router is whole on every rank (it is small), every rank routes
every token of the same all-reduced hidden states, runs only the experts it holds (rank r:
experts [r·E/tp, (r+1)·E/tp), each whole) and one all-reduce sums the partial outputs, the
same single all-reduce per MLP as a dense layer (models/moe.sliced_moe_experts). With
``split_experts=False`` every rank holds every expert and a sparse layer runs whole, without
the all-reduce. Dense layers among the sparse ones (mlp_only_layers) are split as above;
so are DeepSeek's always-on shared experts (gate/up by columns, down_proj row-parallel: a
second all-reduce in its sparse layers). GPT-OSS's experts split with their biases.

Sink attention (GPT-OSS) and MLA (DeepSeek) split by heads too (parallel/blocks.HEAD_ROWS): a
rank holds its heads' sink logits, or its heads' rows of MLA's q_b_proj and kv_b_proj (the
up-projections the absorbed decode folds into q and the output). MLA's latent is shared by
every head, so its projection (kv_a_proj_with_mqa, q_a_proj and their norms) is whole on
every rank, each computing it, and each rank's cache holds the whole latent (vLLM's layout).

Qwen3.5's layers split by heads too. Gated attention: each rank's heads with their output
gates (q_proj's rows hold [q_h | gate_h] per head, so a contiguous 1/tp of them) and KV heads;
the zero-centred q/k norms act on a head's dimensions and are whole. Gated DeltaNet: each rank
runs its key heads with the value heads they serve (models/sharding/deltanet_parallel.py's
head arithmetic, as training's tensor parallelism splits them): their rows of in_proj_qkv and
of the conv taps (a part of each [q; k; v] section: parallel/blocks.rollout_pieces), of
in_proj_z, in_proj_a and in_proj_b, their A_log and dt_bias, the gated norm whole (one weight
a head dimension), out_proj row-parallel. Nothing of the delta rule crosses heads, so a
rank's recurrent cache holds its heads' conv channels and SSM state [S, Hv / tp, Dk, Dv]
only (cache/kinds.recurrent_state_spec of the local shape), prefilled, copied to a prompt's
samples and rebuilt after a preemption as one process does. Qwen3.5-MoE's gated shared
expert splits like a dense MLP (its sigmoid gate, one scalar a token, whole: it scales the
summed output).

The model is a CausalLM built from the per-rank shape (heads, KV heads, Gated DeltaNet heads
and MLP width divided by tp, the vocabulary whole) with those four modules swapped in, so the
engine's eager prefill, extend and decode (prefill.py, layers/eager.py; the Triton recurrent
step, kernels/delta_step.py, on the rank's heads) run it unchanged; the triton
backend's split layer (layers/split.py) runs o_proj and down_proj with its own matmuls and
sums them with RowParallelLinear.reduce (project_out). The KV cache, sized from its config,
holds this rank's KV heads only. The modules talk through the process group they are given;
nothing here is global, so the same model runs over gloo on CPU processes and over NCCL on
GPUs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.parallel.blocks import even_range, rollout_pieces


def local_shard(name: str, full: torch.Tensor, rank: int, size: int,
                split_experts: bool = True,
                sections: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """``rank``'s slice of the full tensor of parameter ``name`` (a view, but for Gated
    DeltaNet's in_proj_qkv and conv taps: the rows of the rank's heads from each of their
    ``sections``, parallel/blocks.deltanet_sections, concatenated); a packed expert tensor
    [E, ...] gives its E / size experts when ``split_experts``, else all of them."""
    pieces = rollout_pieces(name, tuple(full.shape), rank, size, split_experts, sections)
    views = [full[tuple(slice(start, stop) for start, stop in block)] for block in pieces]
    return views[0] if len(views) == 1 else torch.cat(views)


def _has_dense_layers(config: ModelArchitecture) -> bool:
    return len(config.sparse_layer_indices()) < config.num_hidden_layers


# The token mixers a tensor-parallel rank runs over its share of the heads (any other is
# refused by local_architecture): every mixer kind of models/layer_spec.MIXER_KINDS today.
SPLIT_MIXERS = ("attention", "gated_attention", "gated_deltanet", "sink_attention", "mla")


def unsplit_mixers(config: ModelArchitecture) -> list[str]:
    """The token mixer kinds of ``config`` the tensor-parallel rollout does not split."""
    return sorted({spec.mixer for spec in config.layer_specs() if spec.mixer not in SPLIT_MIXERS})


def shared_expert_width(config: ModelArchitecture) -> int:
    """The width of DeepSeek's always-on shared experts (0: none), split like a dense MLP."""
    return config.moe_intermediate_size * config.n_shared_experts if config.is_moe else 0


def local_architecture(config: ModelArchitecture, size: int,
                       split_experts: bool = True) -> ModelArchitecture:  # fmt: skip
    """The shape one of ``size`` ranks builds: heads, KV heads and MLP width divided, the
    vocabulary and hidden size whole (the logits are gathered). A mixture of experts keeps
    its router and expert width whole; ``split_experts``: the experts must divide by size
    (the experts a rank holds are built by tensor_parallel_model). MLA's num_key_value_heads
    shapes nothing (every head reads the one latent): it need not divide."""
    unsplit = unsplit_mixers(config)
    if unsplit:
        raise ValueError(f"the tensor-parallel rollout does not split {', '.join(unsplit)} "
                         "layers yet: set rollout.tensor_parallel_size=1")  # fmt: skip
    dense = _has_dense_layers(config)
    kv_heads = any(spec.keeps_kv for spec in config.layer_specs())
    recurrent = bool(config.linear_num_key_heads)
    problems = [
        f"{what} = {count}"
        for what, count, applies in (
            ("num_attention_heads", config.num_attention_heads, True),
            ("num_key_value_heads", config.num_key_value_heads, kv_heads),
            ("linear_num_key_heads", config.linear_num_key_heads, recurrent),
            ("intermediate_size", config.intermediate_size, dense),
            ("vocab_size", config.vocab_size, True),
            ("num_experts", config.num_experts, config.is_moe and split_experts),
            ("moe_intermediate_size * n_shared_experts", shared_expert_width(config), True),
            ("shared_expert_intermediate_size", config.shared_expert_intermediate_size, True),
        )
        if applies and count % size
    ]
    if problems:
        raise ValueError(f"tensor parallel size {size} must divide the model's "
                         f"{', '.join(problems)}")  # fmt: skip
    heads = config.num_attention_heads // size
    return dataclasses.replace(
        config,
        num_attention_heads=heads,
        # MLA: every head expands its own k and v from the latent (one "KV head" a head)
        num_key_value_heads=config.num_key_value_heads // size if kv_heads else heads,
        # a model whose every layer is sparse never builds a dense MLP of this width
        intermediate_size=config.intermediate_size // size if dense else config.intermediate_size,
        # Gated DeltaNet: the rank's key heads with the value heads each serves (a multiple)
        linear_num_key_heads=config.linear_num_key_heads // size,
        linear_num_value_heads=config.linear_num_value_heads // size,
        # Qwen3.5-MoE's gated shared expert: a dense MLP's split (its gate whole)
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // size,
    )


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: W's input columns split over the group."""

    def __init__(self, in_local: int, out_features: int, bias: bool, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The group's partial products x_shard @ W_shard^T summed (in place), then the bias
        once."""
        dist.all_reduce(partial, group=self.group)
        return partial if self.bias is None else partial + self.bias


def project_out(linear, x: torch.Tensor, module) -> torch.Tensor:
    """o_proj's or down_proj's output through a decode layer's matmul ``linear(x, weight,
    bias)``: a RowParallelLinear's summed over its group, its bias added after the sum (the
    fused layers' all-reduces, where the eager modules have them)."""
    if isinstance(module, RowParallelLinear):
        return module.reduce(linear(x, module.weight))
    return linear(x, module.weight, module.bias)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V / tp) of the embedding; other ids give zeros, summed over the
    group (exact: one nonzero term per element)."""

    def __init__(self, vocab_size: int, hidden_size: int, group):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.start, stop = even_range(vocab_size, rank, size)
        self.weight = nn.Parameter(torch.empty(stop - self.start, hidden_size))
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered: [..., V] on every rank, the same
    bytes (sampling needs them identical)."""

    def __init__(self, vocab_local: int, hidden_size: int, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden_size))
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).contiguous()  # [..., V / tp]
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(shards, local, group=self.group)
        return torch.cat(shards, dim=-1)


def _split_mixer_output(mixer: nn.Module, hidden_size: int, group) -> None:
    """The mixer's output projection made row-parallel (its input columns are the rank's
    heads): o_proj, or Gated DeltaNet's out_proj. Everything before it is the rank's heads
    already, the mixer built from local_architecture's shape."""
    name = "out_proj" if hasattr(mixer, "out_proj") else "o_proj"
    linear = getattr(mixer, name)
    setattr(mixer, name, RowParallelLinear(linear.in_features, hidden_size,
                                           linear.bias is not None, group))  # fmt: skip


def tensor_parallel_model(config: ModelArchitecture, group, dtype: torch.dtype,
                          device: str | torch.device, split_experts: bool = True,
                          before_allocation=None):  # fmt: skip
    """This rank's shard of a CausalLM of ``config``, uninitialised (load_weights fills it
    with local_shard slices, or reshard.py from a sharded trainer). Its config is the local
    shape (local_architecture). split_experts: a sparse layer holds this rank's experts
    (models/moe.ExpertSlice), else all of them. before_allocation: called with the model
    while it is still on the meta device (engine/expert_spread.py swaps the experts)."""
    from hybridflow.models.llama import CausalLM
    from hybridflow.models.mlps.dense import MLP
    from hybridflow.models.moe import ExpertSlice

    size = dist.get_world_size(group)
    local = local_architecture(config, size, split_experts)
    share = config.num_experts // size
    first = dist.get_rank(group) * share
    with torch.device("meta"):
        model = CausalLM(local)
        stack = model.model
        stack.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        vocab_local = stack.embed_tokens.weight.shape[0]
        model.lm_head = VocabParallelHead(vocab_local, config.hidden_size, group)
        for layer in stack.layers:
            _split_mixer_output(getattr(layer, layer.mixer_name), config.hidden_size, group)
            mlp = layer.mlp
            if not layer.sparse:
                mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, config.hidden_size,
                                                  False, group)  # fmt: skip
                continue
            if split_experts and size > 1:  # the rank's experts, of the layer's own kind
                mlp.experts = type(mlp.experts)(share, config.hidden_size,
                                                config.moe_intermediate_size)  # fmt: skip
                mlp.expert_slice = ExpertSlice(first, group)
            if getattr(mlp, "shared_experts", None) is not None:  # DeepSeek's: a dense MLP's split
                width = shared_expert_width(config) // size
                mlp.shared_experts = MLP(local, width)
                mlp.shared_experts.down_proj = RowParallelLinear(width, config.hidden_size, False,
                                                                 group)  # fmt: skip
            if getattr(mlp, "shared_expert", None) is not None:  # Qwen3.5-MoE's, gated after
                width = local.shared_expert_intermediate_size  # the sum (a scalar a token)
                mlp.shared_expert.down_proj = RowParallelLinear(width, config.hidden_size, False,
                                                                group)  # fmt: skip
        if before_allocation is not None:
            before_allocation(model)
    model.tie_weights()  # the head shares the embedding's shard
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def tensor_parallel_group(model) -> object | None:
    """The process group of a tensor_parallel_model (None: a whole model)."""
    head = getattr(model, "lm_head", None)
    return head.group if isinstance(head, VocabParallelHead) else None


def row_parallel_weights(model) -> set[int]:
    """The ids of the weights whose input columns are split over the group (each
    RowParallelLinear's: o_proj, a dense down_proj)."""
    return {id(module.weight) for module in model.modules()
            if isinstance(module, RowParallelLinear)}  # fmt: skip


def splits_experts(model) -> bool:
    """A tensor-parallel shard whose sparse layers hold a share of the experts."""
    return any(getattr(layer.mlp, "expert_slice", None) is not None
               for layer in model.model.layers)  # fmt: skip


def tensor_parallel_size(model) -> int:
    group = tensor_parallel_group(model)
    return 1 if group is None else dist.get_world_size(group)
