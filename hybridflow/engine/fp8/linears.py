"""The fp8 rollout on the engine's eager passes (prefill.prefill_forward, extend_forward,
layers/eager.decode_forward_torch): the layer kinds the fused decode layers do not run
(gated attention and Gated DeltaNet of Qwen3.5, MLA of DeepSeek-V3 / Moonlight, sink and
sliding-window attention of GPT-OSS, dense MLPs and shared experts beside them).

Those passes call the model's own modules (mixer.project_qkv, a Gated DeltaNet's prefill,
the MLP, ...), so the projections go fp8 where the modules are called: while a pass runs,
each covered ``nn.Linear`` (or RowParallelLinear) of the decoder layers computes through
matmul.Fp8Matmul.linear (W8A8: its e4m3 copy with a scale per output row, the activations
quantized per row), and outside the pass the module is the model's own again (the engine
may decode on the actor's modules, workers/rollout.py's shares_actor_weights, and the
trainer must see bf16 ones).
The copies are matmul.Fp8Matmul's: made with the cache, refreshed in place at every weight
sync (so captured decode graphs stay valid).

What runs fp8, per layer kind:
- attention, gated attention, sink attention: q/k/v/o (biases added in the model dtype);
- Gated DeltaNet: in_proj_qkv, in_proj_z and out_proj;
- MLA: q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa and o_proj;
- dense MLPs and shared experts: gate/up/down;
- routed SwiGLU experts (Qwen3.5-MoE's, DeepSeek's grouped-routed ones): fp8/experts.py.

Kept in the model's dtype (KEPT, or a weight whose dims are not multiples of 16, the fp8
GEMM's operand rule): the norms, routers, conv1d, A_log, dt_bias, sinks and biases (not
Linear modules); in_proj_a and in_proj_b (num_v_heads rows, under 1% of a Gated DeltaNet's
weight bytes, and they set the recurrence's decay and write strength, whose error compounds
over the sequence); shared_expert_gate (one row); MLA's kv_b_proj: decode absorbs it
(W_UK into the query, W_UV into the output, models/mixers/mla_absorbed.py) as per-head
batched products that are no Linear, so an fp8 copy of it would serve prefill's expanded
form only and the two forms would attend with different K/V weights; it is 9% of a
DeepSeek-V3 attention's weight bytes. GPT-OSS's biased experts stay in the model's dtype
too (fp8/experts.expert_tensors says why); the lm_head and embedding as on the fused path.

On a tensor-parallel shard (engine/tensor_parallel.py) the same projections go fp8. The
column-parallel ones (q/k/v, q_b_proj, in_proj_qkv, in_proj_z, gate/up) hold whole rows, each
row's scale its own; MLA's latent projections are whole on every rank. The row-parallel ones
(o_proj, out_proj, a dense or shared down_proj) are RowParallelLinear, no nn.Linear: they are
quantized too, each row with the whole row's scale (matmul.Fp8Matmul takes the MAX of the
ranks' amax at each refresh, so a rank's copy is a slice of one process's), their input per
row over the rank's own columns, and the bias added once, after the all-reduce
(tensor_parallel.project_out). Why per-rank activation scales cost nothing beyond the fp8
rounding: torch._scaled_mm multiplies each rank's partial product by both scales in its
epilogue, so the all-reduce sums x̂_r ŵ_r^T of values already dequantized (x̂_r: rank r's
columns of x rounded on its own row grid; ŵ_r: its columns of the rounded weight), which is
x̂ ŵ^T exactly, up to the fp32 sum order; no e4m3 values of different scales are ever added. A
rank's share of the routed experts (models/moe.ExpertSlice) runs from its e4m3 copies
(fp8/experts.py: whole experts, one process's scales), the partial outputs summed as in the
model's dtype (layers/moe.fp8_routed_experts). The copies refresh in place at every weight
sync on every rank (a collective: the ranks refresh together, as they decode in lockstep).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hybridflow.engine.tensor_parallel import RowParallelLinear, project_out

# Projections kept in the model's dtype (the module docstring says why), by attribute name
KEPT = ("in_proj_a", "in_proj_b", "shared_expert_gate", "kv_b_proj")
# torch._scaled_mm's operands: both dims of an fp8 weight multiples of 16
FP8_DIM_MULTIPLE = 16


def eager_linears(model) -> list[nn.Module]:
    """The projections of ``model``'s decoder layers the fp8 eager passes quantize (the module
    docstring's list), in layer order: nn.Linear modules and, on a tensor-parallel shard, the
    row-parallel ones (tensor_parallel.RowParallelLinear). Subclasses count: an actor training
    in FP8 shares torchao's Float8Linear modules (learners/fp8_training.py), whose weights the
    copies then take with the trainer's recipe (EngineOptions.fp8_weight_scales)."""
    linears = []
    for layer in model.model.layers:
        for name, module in layer.named_modules():
            projection = isinstance(module, (nn.Linear, RowParallelLinear))
            if not projection or name.rsplit(".", 1)[-1] in KEPT:
                continue
            if any(dim % FP8_DIM_MULTIPLE for dim in module.weight.shape):
                continue
            linears.append(module)
    return linears


def _fp8_forward(fp8, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    # a RowParallelLinear's partial product (already dequantized by its scales) summed over
    # the group, its bias added once after the sum
    out = project_out(fp8.linear, rows, module)
    return out.view(*x.shape[:-1], out.shape[-1])


@contextmanager
def fp8_projections(fp8, linears: list[nn.Module]) -> Iterator[None]:
    """While inside: each of ``linears`` computes through ``fp8`` (matmul.Fp8Matmul: its
    copy of the module's weight; a weight it holds no copy of goes through F.linear). The
    modules' own forward again on the way out, whatever happened inside."""
    for module in linears:
        module.__dict__["forward"] = functools.partial(_fp8_forward, fp8, module)
    try:
        yield
    finally:
        for module in linears:
            module.__dict__.pop("forward", None)


def with_fp8_projections(fp8, linears: list[nn.Module], forward: Callable) -> Callable:
    """``forward`` (an eager pass) run inside fp8_projections."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with fp8_projections(fp8, linears):
            return forward(*args, **kwargs)

    return run
