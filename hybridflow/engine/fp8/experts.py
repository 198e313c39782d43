"""The fp8 rollout's routed experts: weight-only float8 e4m3 copies of each sparse layer's
packed expert tensors (gate_up [E, 2I, H], down [E, H, I]) with a scale per output row, read
by kernels/experts/moe.py's grouped kernels (W_FP8), which widen each tile to the activations' dtype
in their inner loop and scale the fp32 sums in the epilogue.

Why weight-only here, where the dense projections are W8A8 (matmul.py): a decode step of a
mixture of experts reads the experts the batch touches (at 256 rows of Qwen3-30B-A3B, all of
them), so the bytes of the weights are what it costs; the activations a block multiplies are
a few rows, and quantizing them would add a rounding and a launch for no bytes saved.

The scales are the engine's own (weight_scales.quantize_weight with ENGINE_SCALES, the dense
copies' function: amax / 448 per output row), whatever fp8_weight_scales says: the FP8
trainer computes its experts in bf16 (learners/fp8_training.py: the grouped experts are
nn.Parameters, not Linears, so torchao leaves them alone), so there are no trainer bytes to
take, and the experts are quantized once a weight sync, here. The router stays in the model's
dtype (layers/moe.experts_triton).

The copies live as long as the KV cache and are refreshed in place at each sync (captured
CUDA graphs stay valid). A tensor-parallel shard holds whole experts (its share,
engine/tensor_parallel.py), so its rows' scales are those of the one-process engine.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridflow.engine.fp8.e4m3 import E4M3
from hybridflow.engine.fp8.rows import quantize_rows
from hybridflow.engine.fp8.weight_scales import ENGINE_SCALES, quantize_weight

# Elements quantized at once: quantize_weight widens its input to fp32, so a whole layer's
# gate_up (Qwen3-30B-A3B: 403M elements, 1.6 GB in fp32) is taken a few experts at a time
CHUNK_ELEMENTS = 1 << 26


class Fp8ExpertWeights(NamedTuple):
    """One sparse layer's experts in e4m3: weight ≈ values * scale[..., None] per row."""

    gate_up: torch.Tensor  # [E, 2I, H] float8_e4m3fn
    gate_up_scale: torch.Tensor  # [E, 2I] fp32
    down: torch.Tensor  # [E, H, I] float8_e4m3fn
    down_scale: torch.Tensor  # [E, H] fp32


def expert_tensors(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gate_up, down) of a layer whose MLP is routed SwiGLU experts packed as
    models/moe.Experts holds them ([E, out, in]: Qwen3-MoE's, Mixtral's, Qwen3.5-MoE's
    beside its shared expert, DeepSeek's grouped-routed ones); None for any other MLP.

    GPT-OSS's biased experts (stored [E, in, out], ``stored_in_out``) stay in the model's
    dtype under fp8: their decode runs on torch._grouped_mm (layers/biased_moe.py's
    DECODE_ROWS: the grouped Triton kernels read that layout across its rows: 116.1 ms
    against 20.5 for a gpt-oss-20b step of 256 rows), which takes no e4m3 weights with row scales, and an e4m3 copy
    re-laid [E, out, in] for the W_FP8 kernels would run them at that slower speed."""
    if not getattr(layer, "sparse", False):
        return None
    experts = getattr(layer.mlp, "experts", None)
    if getattr(experts, "stored_in_out", False):
        return None
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return None
    return gate_up, down


@torch.no_grad()
def quantize_experts_into(weight: torch.Tensor, values: torch.Tensor, scale: torch.Tensor,
                          chunk_elements: int = CHUNK_ELEMENTS) -> None:  # fmt: skip
    """weight [E, N, K] -> values [E, N, K] e4m3 and scale [E, N] fp32 in place, each row
    quantized by weight_scales.quantize_weight (the engine's scales), a few experts at a time
    (at most chunk_elements, at least one expert, widened to fp32 at once). On CUDA by the
    activations' Triton quantizer (fp8/rows.quantize_rows, the same bytes and scales bit for
    bit): one pass over the weight, where torch's takes several over an fp32 copy (a
    refresh quantizes all of Qwen3-30B-A3B's 29B expert weights)."""

    experts, rows, depth = weight.shape
    step = max(1, chunk_elements // max(rows * depth, 1))
    for first in range(0, experts, step):
        part = weight[first : first + step]
        if weight.is_cuda:
            quantized, row_scale = quantize_rows(part.flatten(0, 1).contiguous())
        else:
            quantized, row_scale = quantize_weight(part.flatten(0, 1), ENGINE_SCALES)
        values[first : first + step].copy_(quantized.view(part.shape))
        scale[first : first + step].copy_(row_scale.view(part.shape[:2]))


def dequantized(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An expert tensor's e4m3 copy widened back: values [E, N, K] * scale [E, N] in dtype
    (what the W_FP8 kernels multiply by, for the torch reference step on the CPU)."""
    return (values.float() * scale[..., None]).to(dtype)


def _empty_like_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
    return values, torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)


class Fp8Experts:
    """The e4m3 copies of every sparse layer's experts of ``model``, by layer index; made
    and remade by :meth:`refresh` (matmul.Fp8Matmul.refresh calls it)."""

    def __init__(self, model):
        self.model = model
        self.layers: dict[int, Fp8ExpertWeights] = {}

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantize the live expert weights into the copies (in place where a copy of the
        same shape exists, so graphs that read them stay valid)."""
        layers = {}
        for index, layer in enumerate(self.model.model.layers):
            tensors = expert_tensors(layer)
            if tensors is None:
                continue
            gate_up, down = tensors
            copy = self.layers.get(index)
            if copy is None or (copy.gate_up.shape, copy.down.shape) != (gate_up.shape,
                                                                        down.shape):  # fmt: skip
                copy = Fp8ExpertWeights(*_empty_like_quantized(gate_up),
                                        *_empty_like_quantized(down))  # fmt: skip
            quantize_experts_into(gate_up, copy.gate_up, copy.gate_up_scale)
            quantize_experts_into(down, copy.down, copy.down_scale)
            layers[index] = copy
        self.layers = layers

    def of(self, index: int) -> Fp8ExpertWeights | None:
        """Layer ``index``'s copies (None: a dense layer, or experts of another kind)."""
        return self.layers.get(index)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for copy in self.layers.values() for t in copy)
