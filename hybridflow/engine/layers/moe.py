"""The mixture-of-experts MLP of a sparse decoder layer in the engine: routing (recorded for
routing replay), then the experts, for decode, prefill and extend passes alike.

`experts_triton` is the triton backend's: the router's logits by cuBLAS (as the model
computes them), then kernels/experts/moe.py's fused routing and grouped expert matmuls (or, for
prefill-sized passes on Hopper when asked, torch._grouped_mm: `ExpertMatmuls`).
`experts_torch` is the torch backend's: the model's own functions (models/moe.py), bitwise.
Both read the experts' packed weights in place (no copy) and write each token's expert ids to
the routing record (kv_cache.KVCache.routes) at the token's cache position when given one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.engine.layers.pair_order import rows_in_pair_order, sorted_pair_rows


def is_sparse(layer) -> bool:
    """The layer's MLP is a mixture of experts (models/moe.py's SparseMoeBlock)."""
    return bool(getattr(layer, "sparse", False))


def has_experts(model) -> bool:
    return any(is_sparse(layer) for layer in model.model.layers)


def sparse_indices(model) -> list[int | None]:
    """Per layer, its index on the routing record's layer axis (None: a dense layer)."""
    indices, count = [], 0
    for layer in model.model.layers:
        indices.append(count if is_sparse(layer) else None)
        count += is_sparse(layer)
    return indices


@dataclass
class RouteTarget:
    """Where a pass's tokens record their expert ids: routes [entries, positions, L_sparse, k]
    (the cache's routing record), each token at (entries[t], offsets[t]), its cache location."""

    routes: torch.Tensor
    entries: torch.Tensor
    offsets: torch.Tensor


@dataclass(frozen=True)
class ExpertMatmuls:
    """How the expert matmuls run on the triton backend. grouped_mm_from: tokens from which a
    prefill or extend pass uses torch._grouped_mm (Hopper, 16-bit) instead of the Triton
    grouped kernels; None: never. Decode steps always run the Triton kernels (CUDA graphs)."""

    grouped_mm_from: int | None = None

    def use_grouped_mm(self, tokens: int, x: torch.Tensor, prefill: bool) -> bool:
        return (
            prefill
            and self.grouped_mm_from is not None
            and tokens >= self.grouped_mm_from
            and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device)[0] == 9
        )


def _router_weight(mlp, x: torch.Tensor) -> torch.Tensor:
    weight = mlp.gate.weight
    return weight if weight.dtype == x.dtype else weight.to(x.dtype)


def route_target(cache, entries: torch.Tensor, offsets: torch.Tensor) -> RouteTarget | None:
    """The pass's RouteTarget in the cache's routing record (None: the cache keeps none)."""
    routes = getattr(cache, "routes", None)
    return None if routes is None else RouteTarget(routes, entries, offsets)


def mlp_torch(layer, x: torch.Tensor, target: RouteTarget | None, sparse_index: int | None,
              keep: torch.Tensor | None = None, expert_step: str = "torch",
              fp8=None) -> torch.Tensor:  # fmt: skip
    """The layer's MLP on x [N, H] with the model's own modules (rows `keep` only, when given;
    a sparse layer routes every row first, recording them; a shared expert beside the routed
    ones, Qwen3.5-MoE's, adds its gated output as the model's forward_routed does).
    expert_step: "triton" runs GPT-OSS's biased experts through their grouped paths
    (layers/biased_moe.py) and DeepSeek's routed experts through the Triton grouped kernels
    (routed_experts_triton), "torch" through the model's. fp8: the layer's routed experts
    as fp8/experts.Fp8ExpertWeights (the fp8 rollout; None: the model's weights), run by
    fp8_routed_experts."""
    if sparse_index is None:
        return layer.mlp(x if keep is None else x[keep])
    grouped = expert_step == "triton"
    if layer.spec.mlp == "grouped_experts_shared":
        return self_routed_experts_torch(layer.mlp, x, target, sparse_index, keep, grouped, fp8)
    out = experts_torch(layer.mlp, x, target, sparse_index, keep, grouped, fp8)
    shared = getattr(layer.mlp, "shared_expert", None)
    if shared is None:
        return out
    rows = x if keep is None else x[keep]
    gated = torch.sigmoid(layer.mlp.shared_expert_gate(rows)) * shared(rows)
    return out + gated.to(out.dtype)


def self_routed_experts_torch(mlp, x: torch.Tensor, target: RouteTarget | None,
                              sparse_index: int, keep: torch.Tensor | None = None,
                              grouped: bool = False, fp8=None) -> torch.Tensor:  # fmt: skip
    """experts_torch's contract for an MLP that routes by its own rule (its route():
    DeepSeek's grouped sigmoid router, models/mlps/grouped_experts.py), its always-on shared
    experts added as the model's forward_routed adds them (they route nothing, record
    nothing). grouped: where triton_experts_run says it can, the routed experts through
    routed_experts_triton, and DeepSeek-V3's routing after its fp32 linear map in one kernel
    (kernels/experts/grouped_route.py, its ids recorded there). fp8: mlp_torch's."""
    fp8 = fp8 if fp8 is not None and fp8_experts_run(mlp) else None
    grouped = grouped and (triton_experts_run(mlp, x) or fp8 is not None and x.is_cuda)
    if grouped and getattr(mlp, "topk_method", None) == "noaux_tc":
        ids, weights = _grouped_route_triton(mlp, x, target, sparse_index)
    else:
        _, ids, weights = mlp.route(x, None)
        if target is not None:
            routes = target.routes
            routes[target.entries, target.offsets, sparse_index] = ids.to(routes.dtype)
    if keep is not None:
        x, ids, weights = x[keep], ids[keep], weights[keep]
    if fp8 is not None:
        out = fp8_routed_experts(mlp, x, ids, weights, fp8, grouped)
    elif grouped:
        out = routed_experts_triton(mlp, x, ids, weights)
    else:
        out = mlp.run_experts(x, ids, weights)
    shared = getattr(mlp, "shared_experts", None)
    return out if shared is None else out + shared(x).to(out.dtype)


def _grouped_route_triton(mlp, x: torch.Tensor, target: RouteTarget | None,
                          sparse_index: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """GroupedExpertsMoeBlock.route's (ids, weights) for noaux_tc: the fp32 linear map as the
    model computes it, then kernels/experts/grouped_route.py (ids int32, recorded at `target`)."""
    from hybridflow.engine.kernels.experts import routing
    from hybridflow.engine.kernels.experts.grouped_route import grouped_route

    logits = F.linear(x.float(), mlp.gate.weight.float())  # [N, E]
    record = None
    if target is not None:
        record = routing.RouteRecord(target.routes, target.entries, target.offsets,
                                     column=sparse_index * mlp.top_k)  # fmt: skip
    return grouped_route(logits, mlp.gate.e_score_correction_bias, mlp.top_k, mlp.n_group,
                         mlp.topk_group, mlp.norm_topk_prob, mlp.routed_scaling_factor, record)  # fmt: skip


def triton_experts_run(mlp, x: torch.Tensor) -> bool:
    """routed_experts_triton covers this block and input: every expert here (no expert
    parallelism, no tensor-parallel slice, no replicas), no LoRA on them, the weights in x's
    dtype and x's rows contiguous (the kernels' operands)."""
    split = (getattr(mlp, name, None) is not None
             for name in ("expert_group", "expert_slice", "expert_spread"))  # fmt: skip
    if any(split) or _active_adapters(mlp) is not None:
        return False
    return mlp.experts.gate_up_proj.dtype == x.dtype and x.stride(-1) == 1


def fp8_experts_run(mlp) -> bool:
    """The fp8 copies of the block's routed experts (fp8/experts.py) can stand for them: the
    experts held here are every expert or a tensor-parallel rank's share of them (an
    ExpertSlice, whose copies hold its experts: fp8_routed_experts sums the group's partial
    outputs), not training's expert parallelism or experts over replicas; no LoRA on them.
    Elsewhere the experts run in the model's dtype."""
    split = (getattr(mlp, name, None) is not None
             for name in ("expert_group", "expert_spread"))  # fmt: skip
    return not any(split) and _active_adapters(mlp) is None


def fp8_routed_experts(mlp, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fp8,
                       grouped: bool) -> torch.Tensor:  # fmt: skip
    """SparseMoeBlock.run_experts' contract over the experts' e4m3 copies (fp8: fp8/experts.
    Fp8ExpertWeights, weight-only: x stays in the model's dtype). On CUDA, or where grouped
    is asked, the W_FP8 grouped kernels (routed_experts_triton), prefill and extend included;
    on the CPU's torch step, the model's moe_experts over the copies widened back (the
    reference arithmetic of the same weights). A tensor-parallel rank's share of the experts
    (ExpertSlice): its copies' experts, the group's partial outputs summed."""
    if grouped or x.is_cuda:
        return routed_experts_triton(mlp, x.contiguous(), ids, weights, fp8)
    from hybridflow.engine.fp8.experts import dequantized
    from hybridflow.models.moe import moe_experts, sliced_moe_experts

    gate_up = dequantized(fp8.gate_up, fp8.gate_up_scale, x.dtype)
    down = dequantized(fp8.down, fp8.down_scale, x.dtype)
    expert_slice = getattr(mlp, "expert_slice", None)
    if expert_slice is not None:
        return sliced_moe_experts(x, ids, weights, gate_up, down, expert_slice,
                                  mlp.expert_backend)  # fmt: skip
    return moe_experts(x, ids, weights, gate_up, down, mlp.expert_backend)


def routed_experts_triton(mlp, x: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor, fp8=None) -> torch.Tensor:  # fmt: skip
    """SparseMoeBlock.run_experts' contract (x [T, H], ids / weights [T, k] -> [T, H]) on
    kernels/experts/moe.py's grouped kernels, the routing given (a block that routes by its own
    rule): the pairs sorted by expert in blocks of block_rows, silu(gate) * up in the gate/up
    kernel's epilogue, the k rows weighted and summed in fp32 in one launch. At 256 decode
    rows the model's moe_experts took 0.55 ms a Qwen3-30B-A3B layer to these kernels' 0.32
    (H200, docs/performance.md): its argsort, gathered rows, SiLU passes and fp32 weighted
    sum around torch._grouped_mm. No host sync. fp8: the experts' e4m3 copies
    (fp8/experts.Fp8ExpertWeights), read in the kernels' W_FP8 mode. A tensor-parallel rank's
    share of the experts (an ExpertSlice: the fp8 copies only, triton_experts_run refuses the
    model-dtype path there) runs its experts and sums the group's partial outputs, as
    experts_triton does."""
    from hybridflow.engine.kernels.experts import moe

    gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
    scales = (None, None)
    if fp8 is not None:
        gate_up, down, scales = fp8.gate_up, fp8.down, (fp8.gate_up_scale, fp8.down_scale)
    expert_slice = getattr(mlp, "expert_slice", None)
    ids = ids.to(torch.int32).contiguous()
    block_m = moe.block_rows(x.shape[0], ids.shape[1], gate_up.shape[0])
    first = None if expert_slice is None else expert_slice.first
    blocks = moe.align_pairs(ids, gate_up.shape[0], block_m, first)
    act = moe.grouped_gate_up(x, gate_up, blocks, scale=scales[0])
    pair_out = moe.grouped_down(act, down, blocks, scale=scales[1])
    out = moe.combine(pair_out, weights.float().contiguous())
    if expert_slice is not None:  # the partial outputs of the group's ranks, summed
        import torch.distributed as dist

        dist.all_reduce(out, group=expert_slice.group)
    return out


def _active_adapters(mlp):
    """The experts' LoRA (models/moe.py's ExpertLoRA) when attached and on, else None."""
    adapters = getattr(mlp.experts, "lora", None)
    return None if adapters is None or adapters.disabled else adapters


def experts_torch(
    mlp, x: torch.Tensor, target: RouteTarget | None, sparse_index: int,
    keep: torch.Tensor | None = None, grouped: bool = False, fp8=None,
) -> torch.Tensor:  # fmt: skip
    """x [N, H] (post-attention normed) -> the MLP's output [N, H]: the model's own routing and
    experts (models/moe.py), the expert ids recorded at the tokens' cache positions. keep: every
    token is routed (and recorded), the experts run for these rows only -> [len(keep), H].
    grouped: GPT-OSS's experts on the Triton step's grouped paths (layers/biased_moe.py).
    fp8: mlp_torch's (GPT-OSS's biased experts have none: fp8/experts.expert_tensors)."""
    from hybridflow.models.moe import moe_experts, router

    if hasattr(mlp, "experts_output"):  # GPT-OSS's biased router and experts
        from hybridflow.engine.layers.biased_moe import biased_experts_torch

        return biased_experts_torch(mlp, x, target, sparse_index, keep, grouped)
    ids, weights, _ = router(x, _router_weight(mlp, x), mlp.top_k, mlp.norm_topk_prob)
    if target is not None:
        target.routes[target.entries, target.offsets, sparse_index] = ids.to(target.routes.dtype)
    if keep is not None:
        x, ids, weights = x[keep], ids[keep], weights[keep]
    if fp8 is not None and fp8_experts_run(mlp):
        return fp8_routed_experts(mlp, x, ids, weights, fp8, grouped)
    if getattr(mlp, "expert_spread", None) is not None:  # over the replicas (expert_spread.py)
        from hybridflow.engine.expert_spread import spread_moe_experts

        return spread_moe_experts(mlp, x, ids, weights, sparse_index)
    experts = mlp.experts
    expert_slice = getattr(mlp, "expert_slice", None)
    if expert_slice is not None:  # this rank's experts, summed over the group (tensor_parallel.py)
        from hybridflow.models.moe import sliced_moe_experts

        return sliced_moe_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj,
                                  expert_slice, mlp.expert_backend)  # fmt: skip
    return moe_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj,
                       mlp.expert_backend, _active_adapters(mlp))  # fmt: skip


def experts_triton(
    mlp,
    x: torch.Tensor,
    target: RouteTarget | None,
    sparse_index: int,
    matmuls: ExpertMatmuls = ExpertMatmuls(),
    keep: torch.Tensor | None = None,
    prefill: bool = False,
    fp8=None,
) -> torch.Tensor:
    """experts_torch's contract on the fused kernels: no host sync, static shapes (the grid is
    the bound for any routing), so decode steps replay as CUDA graphs. prefill: a prefill or
    extend pass (ExpertMatmuls may run torch._grouped_mm). fp8: the layer's experts as
    fp8/experts.Fp8ExpertWeights (the fp8 rollout): the grouped kernels read their e4m3
    bytes (weight-only; x stays in the model's dtype), prefill included (torch._grouped_mm
    takes no such weights); the router reads the model's own weight."""
    from hybridflow.engine.kernels.experts import moe, routing

    if _active_adapters(mlp) is not None:  # unmerged expert LoRA: the model's own grouped path
        return experts_torch(mlp, x, target, sparse_index, keep)
    logits = F.linear(x, _router_weight(mlp, x))  # [N, E], rounded as the model's router
    record = None
    if target is not None:
        record = routing.RouteRecord(target.routes, target.entries, target.offsets,
                                     column=sparse_index * mlp.top_k)  # fmt: skip
    ids, weights = routing.route_topk(logits, mlp.top_k, mlp.norm_topk_prob, record)
    if keep is not None:
        x, ids, weights = x[keep], ids[keep], weights[keep]
    if getattr(mlp, "expert_spread", None) is not None:  # over the replicas (expert_spread.py)
        from hybridflow.engine.expert_spread import spread_moe_experts

        run_local = spread_local_experts(mlp, fp8, matmuls if prefill else None)
        return spread_moe_experts(mlp, x, ids, weights, sparse_index, run_local)
    tokens = x.shape[0]
    gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
    expert_slice = getattr(mlp, "expert_slice", None)  # this rank's experts (tensor_parallel.py)
    first = None if expert_slice is None else expert_slice.first
    if fp8 is None and matmuls.use_grouped_mm(tokens, x, prefill):
        pair_out = _pairs_grouped_mm(x, ids, gate_up, down, first)
    else:
        block_m = moe.block_rows(tokens, mlp.top_k, mlp.num_experts)  # pairs per expert
        blocks = moe.align_pairs(ids, gate_up.shape[0], block_m, first)
        scales = (None, None)
        if fp8 is not None:
            gate_up, down, scales = fp8.gate_up, fp8.down, (fp8.gate_up_scale, fp8.down_scale)
        act = moe.grouped_gate_up(x, gate_up, blocks, scale=scales[0])
        pair_out = moe.grouped_down(act, down, blocks, scale=scales[1])
    out = moe.combine(pair_out, weights)
    if expert_slice is not None:  # the partial outputs of the group's ranks, summed
        import torch.distributed as dist

        dist.all_reduce(out, group=expert_slice.group)
    return out


def engine_local_experts(engine):
    """serve_peers' run_local_of for an engine: on the triton backend the fused layers'
    grouped kernels (fp8: the experts' e4m3 copies, made with the cache), as its passes run
    them; None: the model's experts modules, as the torch backend's passes run them."""
    if not engine.spread or engine.decode_backend != "triton":
        return None

    def run_local_of(index: int, mlp):
        return spread_local_experts(
            mlp, None if engine.fp8 is None else engine.fp8.experts.of(index)
        )

    return run_local_of


def spread_local_experts(mlp, fp8=None, matmuls: ExpertMatmuls | None = None):
    """expert_parallel_moe's run_local for a block whose experts are spread over replicas
    (engine/expert_spread.py), on the fused layers' kernels: the rows this rank receives
    (rows [R, H], their local expert ids [R, 1]) -> each row's expert output [R, H],
    unweighted (the sender weighs and sums). The grouped Triton kernels over this rank's
    E / ep experts (fp8: their e4m3 copies, fp8/experts.Fp8ExpertWeights); matmuls: a
    prefill or extend pass's ExpertMatmuls, which may pick torch._grouped_mm (None: a
    decode step, the Triton kernels)."""
    from hybridflow.engine.kernels.experts import moe

    gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
    scales = (None, None)
    if fp8 is not None:
        gate_up, down, scales = fp8.gate_up, fp8.down, (fp8.gate_up_scale, fp8.down_scale)

    def run_local(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        received = rows.shape[0]
        if received == 0:  # no rows for this rank's experts in this round (sizes: host)
            return rows.new_zeros(0, down.shape[1])
        ids = local_ids.to(torch.int32).contiguous()
        if fp8 is None and matmuls is not None and matmuls.use_grouped_mm(received, rows, True):
            return _pairs_grouped_mm(rows, ids, gate_up, down)
        blocks = moe.align_pairs(
            ids, gate_up.shape[0], moe.block_rows(received, 1, gate_up.shape[0])
        )
        act = moe.grouped_gate_up(rows, gate_up, blocks, scale=scales[0])
        return moe.grouped_down(act, down, blocks, scale=scales[1])  # [R * 1, H]: row order

    return run_local


def _pairs_grouped_mm(x, ids, gate_up, down, first_expert: int | None = None) -> torch.Tensor:
    """Each (token, expert) pair's expert output [T * k, H] through torch._grouped_mm (one
    launch per projection, CUTLASS on Hopper): pairs sorted by expert (sorted_pair_rows),
    SiLU*up by the row-wise kernel, rows gathered back to pair order (zeros for pairs routed
    to experts held elsewhere: first_expert, align_pairs)."""
    from hybridflow.engine.kernels import rowwise

    rows, pair_index, blocks = sorted_pair_rows(x, ids, gate_up.shape[0], first_expert)
    ends = blocks.group_ends
    inner = gate_up.shape[1] // 2
    gate_up_rows = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=ends)
    act = rowwise.silu_mul(gate_up_rows[:, :inner], gate_up_rows[:, inner:])
    expert_rows = torch._grouped_mm(act, down.transpose(-2, -1), offs=ends)
    return rows_in_pair_order(expert_rows, pair_index, ids.numel(), blocks.subset)
