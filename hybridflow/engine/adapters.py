"""Decoding a model whose projections carry LoRA adapters, unmerged (rollout.lora_in_place).

The trainer injects peft LoRA layers into its own CausalLM (learners/lora.py): each targeted
``nn.Linear`` becomes a layer holding the frozen ``base_layer`` and the small ``lora_A`` and
``lora_B``. Merging them for the rollout needs a second copy of every projection (61 GiB for a
32B model in bf16); reading the actor's base weights in place and adding each adapter's
low-rank product instead needs none, at the price of two skinny matmuls per projection and the
split decode layer (the chain and lean layers read weights inside Triton kernels).

Where the engine's paths run:
- the torch backend and the eager prefill/extend call the model's own modules, so peft's
  layers add their adapters themselves;
- the triton backend's layer stack (layers/split.py, prefill and extend included) reads each
  projection's weight and calls ``matmul.linear(x, weight, bias)``: :class:`AdapterMatmul`
  wraps the engine's matmul and adds the product of the adapter that weight belongs to.

The adapters are read live at every call (CUDA graphs capture their storage), so the actor's
optimizer steps reach the next decode step with no copy. Dropout is not applied (generation).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.engine.kernels.launch import PLAIN, Launch


def adapter_layers(model: nn.Module) -> list[nn.Module]:
    """The peft LoRA layers injected into `model` ([] for a plain model).

    A model with LoRA layers has had their module imported; one without is answered without
    importing peft, which costs ~2 s of CPU (transformers, torchao and torch._dynamo with it)
    at every engine's start in a process that trains no adapter."""
    lora = sys.modules.get("peft.tuners.lora")
    if lora is None:  # also where peft, an extra, is not installed
        return []
    return [m for m in model.modules() if isinstance(m, lora.LoraLayer)]


class AdapterMatmul:
    """The decode layer's matmuls (matmul_choice.DecodeMatmul's interface) with LoRA
    adapters added to the projections that have them. inner: the matmul of the base weights
    (None: cuBLAS)."""

    def __init__(self, model: nn.Module, inner=None):
        self.inner = inner
        # keyed by the base weight's identity: the layer stack passes weights, not modules,
        # and peft's layer.weight is its base_layer's Parameter (the same object every call)
        self.by_weight = {id(layer.base_layer.weight): layer for layer in adapter_layers(model)}
        for layer in self.by_weight.values():
            active = layer.active_adapters
            if len(active) != 1 or getattr(layer, "use_dora", {}).get(active[0], False):
                raise ValueError("the engine decodes one plain LoRA adapter per layer "
                                 f"(found {active} on {type(layer).__name__})")  # fmt: skip

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        out = (
            self.inner.linear(x, weight, bias)
            if self.inner is not None
            else F.linear(x, weight, bias)
        )
        layer = self.by_weight.get(id(weight))
        if layer is None or layer.disable_adapters or layer.merged:
            return out
        name = layer.active_adapters[0]
        a, b, scale = layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]
        if x.dtype == out.dtype and out.dim() == 2:
            # x·Aᵀ, then out + scale·(x·Aᵀ)·Bᵀ accumulated in one GEMM epilogue (one rounding
            # where peft's product, scale and add round three times); fp32 adapters (the
            # trainer's, learners/lora.py) are read in the activations' dtype, as autocast would
            xa = F.linear(x, a.to(x.dtype))
            return torch.addmm(out, xa, b.to(x.dtype).t(), alpha=scale)
        delta = F.linear(F.linear(x.to(a.dtype), a), b) * scale  # peft's order
        return (out + delta).to(out.dtype)

    def gate_up_silu(self, x: torch.Tensor, weight_pairs: torch.Tensor,
                     launch: Launch = PLAIN) -> torch.Tensor:  # fmt: skip
        # the fused gate/up copy holds base weights only: the engine runs without fused copies
        raise RuntimeError("AdapterMatmul needs the engine's fuse_projections='none'")
