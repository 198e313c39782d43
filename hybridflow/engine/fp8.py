"""FP8 rollout matmuls (EngineOptions.weight_format = "fp8"): W8A8 in float8 e4m3.

Weights: each projection (the fused q/k/v and gate/up copies, o_proj, down_proj) is quantized
per output channel (scale = the row's max |w| / 448) into an fp8 copy that lives as long as
the KV cache and is refreshed in place from the live bf16 parameters at every weight sync, so
captured CUDA graphs stay valid. Activations: quantized per token (row) in front of each
matmul. The product: torch._scaled_mm with both scale vectors, bf16 out. The embedding, the
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

from hybridflow.engine.kernels.launch import PLAIN, Launch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
_TINY = 1e-12  # an all-zero row gets a finite scale (and quantizes to zeros)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [M, K] e4m3, scale [M, 1] fp32) with x ≈ x8 * scale per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / E4M3_MAX
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_reference on CUDA in one Triton launch (kernels/fp8_quant.py)."""
    if not x.is_cuda:
        return quantize_rows_reference(x)
    from hybridflow.engine.kernels.fp8_quant import quantize_rows_triton

    return quantize_rows_triton(x)


def scaled_linear(x: torch.Tensor, weight8: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] (model dtype) times an fp8 weight [N, K] with per-channel scales [1, N] ->
    [M, N] in x's dtype."""
    x8, x_scale = quantize_rows(x.contiguous())
    out = torch._scaled_mm(x8, weight8.t(), scale_a=x_scale, scale_b=weight_scale,
                           out_dtype=x.dtype)  # fmt: skip
    return out if bias is None else out + bias


class Fp8Matmul:
    """The decode layer's matmuls (the interface of matmul_choice.DecodeMatmul) over fp8
    copies of the model's projections. model: the CausalLM; fused: weights.FusedProjections
    (its q/k/v and gate/up copies are the ones quantized) or None. A weight it holds no copy
    of (none: every projection is covered) goes through F.linear in the model dtype."""

    def __init__(self, model, fused):
        self.model, self.fused = model, fused
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.refresh()

    def sources(self) -> list[torch.Tensor]:
        """The bf16 weights quantized: per layer q/k/v (fused or each), o_proj, gate/up (fused
        or each), down_proj."""
        fused, weights = self.fused, []
        for index, layer in enumerate(self.model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if fused is not None:
                weights.append(fused.qkv_weight[index])
            else:
                weights += [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            weights.append(attn.o_proj.weight)
            if fused is not None and fused.gate_up_weight is not None:
                weights.append(fused.gate_up_weight[index])
            else:
                weights += [mlp.gate_proj.weight, mlp.up_proj.weight]
            weights.append(mlp.down_proj.weight)
        return weights

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantize the live weights into the fp8 copies (in place where one exists for the
        same tensor, so graphs that read them stay valid)."""
        copies = {}
        for weight in self.sources():
            key = weight.data_ptr()  # the fused copies' per-layer views are new objects each
            old = self.copies.get(key)  # time: the storage, not the view, is the identity
            if old is not None and old[0].shape == weight.shape:
                _, weight8, scale = old
            else:
                weight8 = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
                scale = torch.empty(1, weight.shape[0], dtype=torch.float32, device=weight.device)
            quantized, row_scale = quantize_rows_reference(weight)
            weight8.copy_(quantized)
            scale.copy_(row_scale.view(1, -1))
            copies[key] = (weight, weight8, scale)
        self.copies = copies

    def nbytes(self) -> int:
        return sum(w8.numel() + s.numel() * 4 for _, w8, s in self.copies.values())

    def linear(self, x, weight, bias=None) -> torch.Tensor:
        copy = self.copies.get(weight.data_ptr())
        if copy is None or copy[0].shape != weight.shape:
            return F.linear(x, weight, bias)
        return scaled_linear(x, copy[1], copy[2], bias)

    def gate_up_silu(self, x: torch.Tensor, weight_pairs: torch.Tensor,
                     launch: Launch = PLAIN) -> torch.Tensor:  # fmt: skip
        """silu(gate) * up of the interleaved gate/up product (gemm.gate_up_silu_cublas)."""
        from hybridflow.engine.kernels import rowwise

        return rowwise.silu_mul_pairs(self.linear(x, weight_pairs), launch=launch)
