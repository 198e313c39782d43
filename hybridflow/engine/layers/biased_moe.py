"""GPT-OSS's mixture-of-experts MLP in the engine's eager passes: a router with a bias,
experts with biases and the clamped SwiGLU (models/mlps/biased_experts.py), each token's
expert ids recorded at its cache position for routing replay, as layers/moe.experts_torch
does for the plain experts.

Three ways to run the experts: the model's own (models/moe.moe_experts: grouped GEMMs on
CUDA with each bias and the clamped SwiGLU as torch ops over the [T * k, 2I] product), and
two on the Triton step. Up to DECODE_ROWS rows (none now: see it), `biased_experts_triton`: kernels/experts/moe.py's
grouped kernels' way (kernels/experts/biased_grouped.py), the bias and the clamped SwiGLU in the
gate/up kernel's epilogue. Past it, `biased_experts_grouped`: the same torch._grouped_mm over
the pairs sorted by kernels/experts/moe.align_pairs, the gate/up bias and the clamped SwiGLU in one
row-wise kernel (kernels/experts/biased_experts.py). Both fold the down bias into the weighted
combine. At gpt-oss-20b's 32,768 prefill tokens the model's form moves ~30 GB a layer around
its two GEMMs, the grouped one ~8 GB.
"""

from __future__ import annotations

import torch

from hybridflow.models.mlps.biased_experts import topk_softmax_route
from hybridflow.models.moe import active_adapters, local_part

# Rows up to which the Triton step runs the experts on the grouped Triton kernels (decode
# steps and small extend passes), past which on torch._grouped_mm. 0: never. GPT-OSS's experts
# are stored [E, in, out], which these kernels read across their rows: a gpt-oss-20b decode
# step of 256 rows took 116.1 ms on them against 20.5 on torch._grouped_mm (H100 80GB,
# benchmarks/moe_decode_step.py), so they wait for a tile layout of their own
DECODE_ROWS = 0


def biased_experts_torch(mlp, x: torch.Tensor, target, sparse_index: int,
                         keep: torch.Tensor | None = None,
                         grouped: bool = False) -> torch.Tensor:  # fmt: skip
    """x [N, H] (post-attention normed) -> [N, H] (or [len(keep), H]): the block's own
    routing and experts; target: layers/moe.RouteTarget (None: no record); keep: every token
    is routed and recorded, the experts run for these rows only. grouped: the experts
    through biased_experts_grouped where grouped_runs says it can."""
    ids, weights = topk_softmax_route(mlp.router_logits(x), mlp.top_k)
    if target is not None:
        target.routes[target.entries, target.offsets, sparse_index] = ids.to(target.routes.dtype)
    if keep is not None:
        x, ids, weights = x[keep], ids[keep], weights[keep]
    if grouped and x.shape[0] <= DECODE_ROWS and triton_runs(mlp, x):
        return biased_experts_triton(mlp, x, ids, weights)
    if grouped and grouped_runs(mlp, x):
        return biased_experts_grouped(mlp, x, ids, weights)
    return mlp.experts_output(x, ids, weights)


def _split(mlp) -> bool:
    """The block's experts are spread over ranks: expert parallelism, or the tensor-parallel
    rollout's slice (the model's own sliced path sums them: experts_output)."""
    return mlp.expert_group is not None or getattr(mlp, "expert_slice", None) is not None


def triton_runs(mlp, x: torch.Tensor) -> bool:
    """biased_experts_triton covers this block and input: every expert here (not _split), no
    LoRA on them, the weights in x's dtype, x's rows contiguous."""
    experts = mlp.experts
    if _split(mlp) or active_adapters(experts.lora) is not None:
        return False
    return experts.gate_up_proj.dtype == x.dtype and x.stride(-1) == 1


def biased_experts_triton(mlp, x: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """BiasedExpertsMoeBlock.experts_output's contract (x [T, H], ids / weights [T, k] ->
    [T, H]) on the grouped Triton kernels (kernels/experts/biased_grouped.py) over the experts as
    stored: 5 launches (the sort's 2, gate/up with its bias and SwiGLU, down, the combine
    with the down bias), no host sync."""
    from hybridflow.engine.kernels.experts import moe
    from hybridflow.engine.kernels.experts.biased_grouped import biased_down, biased_gate_up

    experts = mlp.experts
    ids = ids.to(torch.int32).contiguous()
    block_m = moe.block_rows(x.shape[0], ids.shape[1], experts.gate_up_proj.shape[0])
    blocks = moe.align_pairs(ids, experts.gate_up_proj.shape[0], block_m)
    act = biased_gate_up(x, experts.gate_up_proj, experts.gate_up_proj_bias, blocks,
                         mlp.swiglu_alpha, mlp.swiglu_limit)  # fmt: skip
    pair_rows = biased_down(act, experts.down_proj, blocks)
    return moe.combine(pair_rows, weights.float().contiguous(), experts.down_proj_bias, ids)


def grouped_runs(mlp, x: torch.Tensor) -> bool:
    """biased_experts_grouped covers this block and input: every expert here (no expert
    parallelism), no LoRA on them, the weights in x's dtype, bf16 on CUDA (torch._grouped_mm's
    kernel there) and rows of 16 bytes' multiples (its operands)."""
    experts = mlp.experts
    if _split(mlp) or active_adapters(experts.lora) is not None:
        return False
    if experts.gate_up_proj.dtype != x.dtype or (x.is_cuda and x.dtype != torch.bfloat16):
        return False
    widths = (x.shape[-1], experts.down_proj.shape[1])
    return all(width * x.element_size() % 16 == 0 for width in widths)


def biased_experts_grouped(mlp, x: torch.Tensor, ids: torch.Tensor,
                           weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """BiasedExpertsMoeBlock.experts_output's contract (x [T, H], ids / weights [T, k] ->
    [T, H]) through torch._grouped_mm on the experts as stored ([E, in, out]: no copy), the
    biases and the clamped SwiGLU in the row-wise kernels. No host sync."""
    from hybridflow.engine.kernels.experts import moe
    from hybridflow.engine.kernels.experts.biased_experts import bias_clamped_swiglu
    from hybridflow.engine.layers.pair_order import rows_in_pair_order, sorted_pair_rows

    experts = mlp.experts
    gate_up, down = local_part(experts.gate_up_proj), local_part(experts.down_proj)
    ids = ids.to(torch.int32).contiguous()
    rows, pair_index, blocks = sorted_pair_rows(x, ids, gate_up.shape[0])
    pairs = ids.numel()
    row_experts = ids.view(-1)[pair_index.clamp(max=pairs - 1)]  # padding: any expert
    gate_up_rows = torch._grouped_mm(rows, gate_up, offs=blocks.group_ends)  # [capacity, 2I]
    act = bias_clamped_swiglu(gate_up_rows, local_part(experts.gate_up_proj_bias), row_experts,
                              mlp.swiglu_alpha, mlp.swiglu_limit)  # fmt: skip
    expert_rows = torch._grouped_mm(act, down, offs=blocks.group_ends)  # [capacity, H]
    pair_rows = rows_in_pair_order(expert_rows, pair_index, pairs, blocks.subset)
    return moe.combine(pair_rows, weights.float().contiguous(),
                       local_part(experts.down_proj_bias), ids)  # fmt: skip
