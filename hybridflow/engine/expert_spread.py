"""Experts across rollout replicas (wide expert parallelism, rollout.expert_parallel_size >
rollout.tensor_parallel_size): attention is data-parallel over the replicas, each replica
generating its own requests, and every sparse layer's experts are spread over all the ranks
of the expert-parallel group, E / ep whole experts a rank (DeepSeek-V3's serving layout,
arXiv:2412.19437 §3.4; vLLM's and SGLang's "DP attention + EP").

One sparse layer on a rank: the whole router routes the replica's tokens (every rank of a
replica routes the same tokens and writes the same routing record), then the tokens travel
to the ranks that hold their experts and back, the all-to-all dispatch and combine of the
trainer's expert parallelism (models/sharding/expert_parallel.expert_parallel_moe). Inside
a tensor-parallel replica each of its tp ranks dispatches 1/tp of the rows and an all-gather
over the replica puts them together, so no expert computes a row twice. Both decode
backends run it: the torch backend's passes compute the rows a rank receives with the
model's moe_experts, the fused split layer of the triton backend (layers/moe.experts_triton:
Triton routing, recorded) with the grouped Triton kernels over the rank's E / ep experts
(layers/moe.spread_local_experts, expert_parallel_moe's ``run_local``; the fp8 rollout: their
e4m3 copies). The families whose layers the eager passes run take the triton backend's steps
for those layers beside their experts module's dispatch. CUDA graphs are not captured: the
all-to-all's sizes are read on the host at every sparse layer.

Every kind of sparse block spreads: the plain routed experts (Qwen3-MoE, Mixtral), beside
Qwen3.5-MoE's gated shared expert (computed whole on each replica, split by columns in a
tensor-parallel one), DeepSeek's self-routed blocks (grouped routing, shared experts: their
experts module takes the spread's dispatch), and GPT-OSS's biased experts (each expert's
two biases travel with it, its clamped SwiGLU runs on the rank that holds it; the router and
its bias stay whole on every rank).

The all-to-alls are collectives of the whole EP group, but the replicas run their own
schedules (prefill, decode, a replica with nothing left). So the group moves in rounds: a
forward pass of any rank is one round, opened at its first sparse layer by a MAX all-reduce
of "still generating" over the group. A rank whose generation is over keeps joining rounds
with no tokens (:func:`serve_peers`: the sparse layers' collectives with zero rows, its
experts computing the others' tokens, on the kernels of its engine's backend) until a round
finds every rank done. Every rank then leaves ``Engine.generate`` after the same rounds;
nothing is global (the groups travel with the model), so the same code runs over gloo on
CPU processes and NCCL on GPUs. A rollout service (agent loops, partial rollouts) joins the
same rounds from its thread, each of its steps one iteration of the group:
engine/serving/spread_rounds.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.models.mlps.biased_experts import BiasedExperts
from hybridflow.parallel.blocks import PACKED_EXPERTS, even_range


@dataclass(frozen=True)
class ExpertSpread:
    """A sparse layer's share of the experts in the wide-EP rollout: its expert tensors hold
    experts [first, first + E / ep), whole."""

    first: int
    group: object
    """The expert-parallel group (every rank that holds a share; ep ranks)."""
    replica: object | None
    """This rank's tensor-parallel group (its replica), None with tp = 1."""


def spread_of(model) -> ExpertSpread | None:
    """The spread of a wide-EP engine model (None: its experts are not spread, or the model
    is not our decoder: the transformers fallback)."""
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        spread = getattr(layer.mlp, "expert_spread", None)
        if spread is not None:
            return spread
    return None


def engine_spreads_experts(model, options) -> bool:
    """Whether an engine over ``model`` spreads its experts over the replicas; refuses CUDA
    graphs with them (the all-to-all's sizes are read on the host at every sparse layer)."""
    spread = spread_of(model) is not None
    if spread and options.cuda_graphs:
        raise ValueError("cuda_graphs=True does not run experts spread over replicas yet "
                         "(the all-to-all's sizes are read on the host at every sparse "
                         "layer): leave cuda_graphs unset")  # fmt: skip
    return spread


def join_round(spread: ExpertSpread, generating: bool, device: torch.device) -> bool:
    """Open a round of the EP group: whether any rank is still generating."""
    flag = torch.tensor([int(generating)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=spread.group)
    return bool(flag.item())


def spread_moe_experts(mlp, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       sparse_index: int, run_local=None) -> torch.Tensor:  # fmt: skip
    """x [N, H] routed to ids/weights [N, k] -> the experts' output [N, H], the experts held
    over the EP group (the engine's passes, layers/moe.py). The first sparse layer of a pass
    opens its round. run_local: this rank's experts on the rows it receives
    (expert_parallel_moe's; the fused layers' grouped Triton kernels), None: the model's
    moe_experts."""
    spread = mlp.expert_spread
    if sparse_index == 0:
        join_round(spread, True, x.device)
    return _dispatch(x, ids, weights, mlp.experts.gate_up_proj, mlp.experts.down_proj, spread,
                     mlp.expert_backend, run_local=run_local)  # fmt: skip


def spread_dispatch(x, ids, weights, gate_up, down, group, backend="auto", adapters=None, *,
                    spread: ExpertSpread, opens_round: bool, activation=None,
                    biases=None) -> torch.Tensor:  # fmt: skip
    """The same through the model's own experts module (the ``dispatch`` of models/moe.Experts
    and of GPT-OSS's BiasedExperts, whose activation and biases come along: the self-routed
    blocks, DeepSeek's grouped experts, GPT-OSS's, and the engine's slow path):
    ``opens_round`` on the model's first sparse layer."""
    if adapters is not None:
        raise ValueError("expert LoRA runs merged in the rollout: experts across replicas "
                         "take no attached adapters")  # fmt: skip
    if opens_round:
        join_round(spread, True, x.device)
    return _dispatch(x, ids, weights, gate_up, down, spread, backend, activation, biases)


def _dispatch(x, ids, weights, gate_up, down, spread: ExpertSpread, backend, activation=None,
              biases=None, run_local=None) -> torch.Tensor:  # fmt: skip
    from hybridflow.models.sharding.expert_parallel import expert_parallel_moe

    experts = partial(expert_parallel_moe, gate_up=gate_up, down=down, group=spread.group,
                      backend=backend, activation=activation, biases=biases,
                      run_local=run_local)  # fmt: skip
    if spread.replica is None:
        return experts(x, ids, weights)
    # the replica's tp ranks hold the same rows: each dispatches its 1/tp, then all-gather
    rank, size = dist.get_rank(spread.replica), dist.get_world_size(spread.replica)
    rows = x.shape[0]
    width = -(-rows // size)  # rows a rank (the last ones may hold fewer, or none)
    start, stop = min(rank * width, rows), min((rank + 1) * width, rows)
    mine = experts(x[start:stop], ids[start:stop], weights[start:stop])
    padded = mine.new_zeros(width, x.shape[1])
    padded[: stop - start] = mine
    chunks = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(chunks, padded, group=spread.replica)
    return torch.cat(chunks)[:rows]


def serve_peers(model, device: torch.device, run_local_of=None) -> int:
    """After this rank's generation: join the EP group's rounds with no tokens (its experts
    serve the other replicas) until every rank is done. -> rounds served. run_local_of:
    (layer index, its MLP) -> the run_local its passes give expert_parallel_moe (the fused
    layers' grouped kernels: layers/moe.spread_local_experts), so that the peers' rows meet
    the kernels they would meet in a pass; None: the layer's own experts module."""
    spread = spread_of(model)
    if spread is None:
        return 0
    sparse = [(index, layer.mlp) for index, layer in enumerate(model.model.layers)
              if getattr(layer, "sparse", False)]  # fmt: skip
    rounds = 0
    while join_round(spread, False, device):
        for index, mlp in sparse:
            run_local = None if run_local_of is None else run_local_of(index, mlp)
            _serve_layer(mlp, spread, model.config.hidden_size, device, run_local)
        rounds += 1
    return rounds


def _serve_layer(mlp, spread: ExpertSpread, hidden: int, device: torch.device,
                 run_local=None) -> None:  # fmt: skip
    """One sparse layer's collectives with no tokens of this rank, opening no round: through
    ``run_local`` when given, else through the layer's own experts module (its weights'
    layout, GPT-OSS's activation and biases)."""
    experts = mlp.experts
    none = torch.zeros(0, hidden, dtype=experts.gate_up_proj.dtype, device=device)
    no_ids = torch.zeros(0, mlp.top_k, dtype=torch.long, device=device)
    no_weights = torch.zeros(0, mlp.top_k, device=device)
    if run_local is not None:
        _dispatch(none, no_ids, no_weights, experts.gate_up_proj, experts.down_proj, spread,
                  mlp.expert_backend, run_local=run_local)  # fmt: skip
        return
    quiet = partial(spread_dispatch, spread=spread, opens_round=False)
    if isinstance(experts, BiasedExperts):
        experts(none, no_ids, no_weights, mlp.activation, mlp.expert_backend, spread.group, quiet)
    else:
        experts(none, no_ids, no_weights, mlp.expert_backend, spread.group, quiet)


def spread_shard(name: str, full: torch.Tensor, ep_rank: int, ep: int, tp_rank: int = 0,
                 tp: int = 1, sections: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """``name``'s slice for this rank (a view): a packed expert tensor [E, ...] its E / ep
    experts, any other tensor its tensor-parallel slice (whole with tp = 1; sections:
    tensor_parallel.local_shard's)."""
    if name.endswith(PACKED_EXPERTS):
        start, stop = even_range(full.shape[0], ep_rank, ep)
        return full.narrow(0, start, stop - start)
    if tp == 1:
        return full
    from hybridflow.engine.tensor_parallel import local_shard

    return local_shard(name, full, tp_rank, tp, split_experts=False, sections=sections)


def expert_parallel_model(config: ModelArchitecture, expert_group, replica_group,
                          dtype: torch.dtype, device: str | torch.device):  # fmt: skip
    """This rank's CausalLM of ``config`` in the wide-EP rollout, uninitialised (fill it with
    spread_shard slices): the tensor-parallel shard of ``replica_group`` (None: tp = 1, every
    dense weight whole), each sparse layer holding its E / ep experts."""
    from hybridflow.models.moe import Experts

    ep, ep_rank = dist.get_world_size(expert_group), dist.get_rank(expert_group)
    if config.num_experts % ep:
        raise ValueError(f"rollout.expert_parallel_size = {ep} must divide the model's "
                         f"num_experts = {config.num_experts}")  # fmt: skip
    share = config.num_experts // ep
    tp = 1 if replica_group is None else dist.get_world_size(replica_group)
    spread = ExpertSpread(ep_rank * share, expert_group, replica_group if tp > 1 else None)

    def spread_experts(model) -> None:
        first = True
        for layer in model.model.layers:
            if layer.sparse:
                mlp = layer.mlp
                kind = BiasedExperts if isinstance(mlp.experts, BiasedExperts) else Experts
                mlp.experts = kind(share, config.hidden_size, config.moe_intermediate_size)
                mlp.expert_spread = spread
                # the model's own experts module (self-routed blocks, the slow path) too
                mlp.expert_group = expert_group
                mlp.expert_dispatch = partial(spread_dispatch, spread=spread, opens_round=first)
                first = False

    if tp > 1:
        from hybridflow.engine.tensor_parallel import tensor_parallel_model

        return tensor_parallel_model(config, replica_group, dtype, device, split_experts=False,
                                     before_allocation=spread_experts)  # fmt: skip
    from hybridflow.models.llama import CausalLM

    with torch.device("meta"):
        model = CausalLM(config)
        spread_experts(model)
    model.tie_weights()
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    return model.eval().requires_grad_(False)
