"""FP8 rollout matmuls (EngineOptions.weight_format = "fp8"): W8A8 in float8 e4m3.

Weights: each projection (the fused q/k/v and gate/up copies, o_proj, down_proj) is quantized
per output channel (scale = the row's max |w| / 448) into an fp8 copy that lives as long as
the KV cache and is refreshed in place from the live bf16 parameters at every weight sync, so
captured CUDA graphs stay valid (or with the FP8 trainer's recipe, fp8/weight_scales.py, when the
actor trains in FP8: the trainer's e4m3 bytes and scales). Activations: quantized per token (row) in front of each
matmul: the split layer's norms and SiLU*up write their outputs as e4m3 rows with scales
(Fp8Rows, rowwise.py), so only the attention output takes a quantize launch of its own. The
product: torch._scaled_mm with both scale vectors, bf16 out. The embedding, the
norms, attention, the KV cache and the lm_head stay in the model dtype, so the sampled
tokens' log-probs come from bf16 logits of fp8-projected hidden states.

Why per-channel weights and per-token activations: decode reads every weight once a step,
so halving weight bytes is what speeds it up; per-channel and per-token scales keep the
rounding error of one matmul near e4m3's 2^-4 relative step instead of a tensor-wide
outlier's. The policy the trainer holds is bf16: the engine's fp8 log-probs differ from it,
which the trainer corrects with truncated importance sampling against the recorded
behaviour log-probs (actor.rollout_is_cap, on by default with rollout.dtype=fp8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.engine.fp8.e4m3 import E4M3, Fp8Rows
from hybridflow.engine.fp8.rows import quantize_rows
from hybridflow.engine.fp8.weight_scales import (
    ENGINE_SCALES,
    amax_rows,
    quantize_weight,
    tensor_amax_rows,
)
from hybridflow.engine.kernels.launch import PLAIN, Launch


def check_fp8_engine(device: torch.device, decode_backend: str, adapted: bool,
                     eager: bool = False) -> None:  # fmt: skip
    """UserError unless an engine on `device` can run fp8 matmuls: the triton backend, over
    weights it may quantize (not LoRA adapters decoded unmerged). eager: a model of layers
    the eager passes run (fp8/linears.py), whose fp8 projections are torch._scaled_mm calls
    in the model's modules: on the CPU (torch's reference kernel) they run on either
    backend; on a GPU they need the triton backend's device, as the fused layers do."""
    from hybridflow.errors import UserError

    if adapted:
        raise UserError("weight_format='fp8' quantizes merged weights, and this model's LoRA "
                        "adapters are decoded unmerged",
                        fix="set rollout.lora_in_place=false, or drop fp8")  # fmt: skip
    if decode_backend != "triton" and not (eager and device.type == "cpu"):
        raise UserError(f"weight_format='fp8' needs the triton decode backend, and this "
                        f"engine on {device} resolved {decode_backend!r}",
                        fix="run on a GPU with fp8 tensor cores (sm_89+), or drop fp8")  # fmt: skip


def scaled_linear(
    x: torch.Tensor | Fp8Rows, weight8: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    fast_accumulation: bool = False,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (model dtype, quantized here; or Fp8Rows already quantized) times an fp8
    weight [N, K] with per-channel scales [1, N] -> [M, N] in out_dtype (default: x's dtype;
    required for Fp8Rows). fast_accumulation: see Fp8Matmul."""
    if not isinstance(x, Fp8Rows):
        out_dtype = out_dtype or x.dtype
        x = quantize_rows(x.contiguous())
    out = torch._scaled_mm(x.values, weight8.t(), scale_a=x.scale, scale_b=weight_scale,
                           out_dtype=out_dtype, use_fast_accum=fast_accumulation)  # fmt: skip
    return out if bias is None else out + bias


class Fp8Matmul:
    """The decode layer's matmuls (the interface of matmul_choice.DecodeMatmul) over fp8
    copies of the model's projections. model: the CausalLM; fused: weights.FusedProjections
    (its q/k/v and gate/up copies are the ones quantized) or None. linears: the nn.Linear
    modules of the engine's eager passes (fp8/linears.eager_linears), quantized instead of
    the fused layers' projections (None: those). A weight it holds no copy of goes through
    F.linear in the model dtype.

    linear takes model-dtype rows or Fp8Rows (what the split layer's e4m3 norms write), and
    gate_up_silu returns Fp8Rows, the down projection's input.

    fast_accumulation: torch._scaled_mm's use_fast_accum. Hopper's fp8 tensor cores then keep
    each tile's partial sums in the MMA's own accumulator (about 14 bits retained, DeepSeek-V3
    report sec. 3.3.2) instead of the kernel promoting them into fp32 every few K steps,
    which costs throughput (not yet measured here). That error stays below what the e4m3
    rounding of both operands (up to 2^-4 of each element) already puts in a product, and
    the trainer corrects the rollout's log-probs by importance sampling either way; so it is
    on by default. The engine holds one Fp8Matmul for prefill, extend and decode: all three
    accumulate the same way.

    weight_scales: how the weights are quantized (weight_scales.py): "engine" (amax / 448 per
    output channel) or the FP8 trainer's recipe, "rowwise" or "tensorwise", whose bytes and
    scales equal those of the trainer's forward (the fused copies then hold the model's
    weights as they are: no norm weight folded in).

    A tensor-parallel shard (engine/tensor_parallel.py) quantizes its slices with the scales of
    the whole weights: a row's amax where the columns are split (o_proj, down_proj) and a
    tensor's amax under tensorwise are the MAX over the group of the shards' (one all-reduce
    a refresh), so each rank's e4m3 bytes and scales are the slices of the one-process
    engine's, and of the FP8 trainer's, whose forward quantizes whole weights: the layout does
    not change the policy's weights. (Scales of each shard's own would round the split rows on
    a finer grid, and differently at every tp.) The activations in front of o_proj and
    down_proj are quantized per row over the rank's own columns, with no collective in the
    step (as vLLM's row-parallel fp8 layers do), so the sums differ from one process's by that
    rounding. The eager passes' projections (``linears``) on a shard likewise, their
    row-parallel ones included (fp8/linears.py)."""

    def __init__(self, model, fused, fast_accumulation: bool = True,
                 weight_scales: str = ENGINE_SCALES, linears=None):  # fmt: skip
        if weight_scales != ENGINE_SCALES and fused is not None and fused.folded:
            raise ValueError(f"weight_scales={weight_scales!r} quantizes the model's own "
                             "weights: the fused copies must not fold the norm weights in")  # fmt: skip
        self.model, self.fused = model, fused
        # the eager passes' projections (fp8/linears.py), quantized instead of the fused
        # layers' (None: the fused decode layers' sources)
        self.linears = linears
        self.fast_accumulation = fast_accumulation
        self.weight_scales = weight_scales
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        from hybridflow.engine.tensor_parallel import tensor_parallel_group

        self.group = tensor_parallel_group(model)  # None: the whole model
        from hybridflow.engine.fp8.experts import Fp8Experts

        # a mixture of experts' routed experts: weight-only e4m3 copies (fp8/experts.py),
        # made by refresh() with the others
        self.experts = Fp8Experts(model)
        self.refresh()

    def sources(self) -> list[torch.Tensor]:
        """The bf16 weights quantized: per layer q/k/v (fused or each), o_proj, gate/up (fused
        or each), down_proj (a sparse layer's experts: fp8/experts.py); with ``linears``,
        their weights (the eager passes': fp8/linears.py)."""
        return [weight for weight, _, _ in self.sources_with_parts()]

    def sources_with_parts(self) -> list[tuple[torch.Tensor, list[torch.Tensor], bool]]:
        """(weight quantized, the model weights it is made of, whether their rows are
        interleaved) for each of :meth:`sources` (a tensorwise scale is each part's own)."""
        if self.linears is not None:
            return [(linear.weight, [linear.weight], False) for linear in self.linears]
        fused, weights = self.fused, []
        for index, layer in enumerate(self.model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            if fused is not None:
                weights.append((fused.qkv_weight[index], qkv, False))
            else:
                weights += [(weight, [weight], False) for weight in qkv]
            weights.append((attn.o_proj.weight, [attn.o_proj.weight], False))
            if getattr(layer, "sparse", False):  # routed experts: self.experts
                continue
            gate_up = [mlp.gate_proj.weight, mlp.up_proj.weight]
            if fused is not None and fused.gate_up_weight is not None:
                weights.append((fused.gate_up_weight[index], gate_up, True))
            else:
                weights += [(weight, [weight], False) for weight in gate_up]
            weights.append((mlp.down_proj.weight, [mlp.down_proj.weight], False))
        return weights

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantize the live weights into the fp8 copies (in place where one exists for the
        same tensor, so graphs that read them stay valid)."""
        self.experts.refresh()
        copies = {}
        sources = self.sources_with_parts()
        for (weight, _, _), row_amax in zip(sources, self._row_amaxes(sources)):
            key = weight.data_ptr()  # the fused copies' per-layer views are new objects each
            old = self.copies.get(key)  # time: the storage, not the view, is the identity
            if old is not None and old[0].shape == weight.shape:
                _, weight8, scale = old
            else:
                weight8 = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
                scale = torch.empty(1, weight.shape[0], dtype=torch.float32, device=weight.device)
            quantized, row_scale = quantize_weight(weight, self.weight_scales, row_amax)
            weight8.copy_(quantized)
            scale.copy_(row_scale.view(1, -1))
            copies[key] = (weight, weight8, scale)
        self.copies = copies

    def _row_amaxes(self, sources) -> list[torch.Tensor | None]:
        """Per source, the [N, 1] amax quantize_weight takes its rows' scales from (None: the
        weight's own). A tensor-parallel shard's are the whole weights' (the class's
        docstring): one MAX all-reduce over the group of every split row's."""
        recipe = self.weight_scales
        if self.group is None:
            return [tensor_amax_rows(parts, interleaved)
                    if recipe == "tensorwise" and len(parts) > 1 else None
                    for _, parts, interleaved in sources]  # fmt: skip
        from hybridflow.engine.tensor_parallel import row_parallel_weights

        amaxes = [amax_rows(weight, parts, interleaved, recipe)
                  for weight, parts, interleaved in sources]  # fmt: skip
        split_columns = row_parallel_weights(self.model)
        shared = [index for index, (weight, _, _) in enumerate(sources)
                  if recipe == "tensorwise" or id(weight) in split_columns]  # fmt: skip
        if shared:
            import torch.distributed as dist

            flat = torch.cat([amaxes[index].flatten() for index in shared])
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
            pieces = flat.split([amaxes[index].numel() for index in shared])
            for index, piece in zip(shared, pieces):
                amaxes[index] = piece.view(-1, 1)
        return amaxes

    def nbytes(self) -> int:
        dense = sum(w8.numel() + s.numel() * 4 for _, w8, s in self.copies.values())
        return dense + self.experts.nbytes()

    def linear(self, x: torch.Tensor | Fp8Rows, weight, bias=None) -> torch.Tensor:
        """x [M, K] (model dtype or Fp8Rows) @ weight.T (+ bias) -> [M, N] in weight's dtype."""
        copy = self.copies.get(weight.data_ptr())
        if copy is None or copy[0].shape != weight.shape:
            if isinstance(x, Fp8Rows):
                x = (x.values.float() * x.scale).to(weight.dtype)
            return F.linear(x, weight, bias)
        return scaled_linear(x, copy[1], copy[2], bias, out_dtype=weight.dtype,
                             fast_accumulation=self.fast_accumulation)  # fmt: skip

    def gate_up_silu(self, x: torch.Tensor | Fp8Rows, weight_pairs: torch.Tensor,
                     launch: Launch = PLAIN) -> Fp8Rows:  # fmt: skip
        """silu(gate) * up of the interleaved gate/up product (gemm.gate_up_silu_cublas),
        written as e4m3 rows for the down projection."""
        from hybridflow.engine.kernels import rowwise

        return rowwise.silu_mul_pairs_e4m3(self.linear(x, weight_pairs), launch=launch)
