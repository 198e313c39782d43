"""LoRA adapters through peft, injected into our own CausalLM (no PeftModel wrapper).

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` by a LoRA layer that
holds the original as ``base_layer`` and freezes every base weight. Parameter names become
``...q_proj.base_layer.weight`` and ``...q_proj.lora_A.default.weight``; :func:`merged_hf_state_dict`
folds the adapters back into plain HF names for export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

ADAPTER = "default"


def apply_lora(
    model: nn.Module, *, rank: int, alpha: float, target_modules: list[str], dropout: float = 0.0
) -> nn.Module:
    """Inject LoRA adapters in place; only adapter weights stay trainable. Returns ``model``."""
    import peft

    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=dropout
    )
    return peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)


def lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model: every LoRA layer returns ``base_layer(x)`` inside the block.

    Sets peft's ``_disable_adapters`` flag directly: peft's public ``enable_adapters(False)``
    also flips ``requires_grad`` of the adapter weights, which must not change under FSDP.
    """
    layers = lora_layers(model)
    previous = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, flag in zip(layers, previous):
            layer._disable_adapters = flag


def lora_scalings(model: nn.Module, prefix_to_strip: str = "") -> dict[str, float]:
    """Module name (HF naming, without ``prefix_to_strip``) -> LoRA scale alpha / r."""
    scalings = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER in scaling:
            scalings[name.removeprefix(prefix_to_strip)] = float(scaling[ADAPTER])
    return scalings


def merged_hf_state_dict(
    state_dict: dict[str, torch.Tensor], scalings: dict[str, float]
) -> dict[str, torch.Tensor]:
    """Fold LoRA into the base weights: ``W + scale · B @ A`` under the plain HF names.

    ``state_dict`` holds full (unsharded) tensors with peft's names; modules without adapters
    pass through unchanged.
    """
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." not in name:
            merged[name] = tensor
            continue
        module, leaf = name.split(".base_layer.")
        if leaf == "weight":
            lora_a = state_dict[f"{module}.lora_A.{ADAPTER}.weight"].float()  # [r, in]
            lora_b = state_dict[f"{module}.lora_B.{ADAPTER}.weight"].float()  # [out, r]
            delta = scalings[module] * (lora_b @ lora_a)
            tensor = (tensor.float() + delta).to(tensor.dtype)
        merged[f"{module}.{leaf}"] = tensor
    return merged
