"""LoRA adapters through peft, injected into our own CausalLM (no PeftModel wrapper).

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` by a LoRA layer that
holds the original as ``base_layer`` and freezes every base weight. Parameter names become
``...q_proj.base_layer.weight`` and ``...q_proj.lora_A.default.weight``; :func:`merge_lora_stream`
folds the adapters back into plain HF names for export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

ADAPTER = "default"


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules: list[str],
    dropout: float = 0.0,
    seed: int = 0,
) -> nn.Module:
    """Inject LoRA adapters in place; only adapter weights stay trainable, in fp32 whatever
    the base's dtype. Returns ``model``.

    ``lora_A`` is drawn from a generator seeded with ``seed`` (``lora_B`` starts at 0), so every
    data-parallel rank creates the same adapters before FSDP shards them, and runs repeat."""
    import peft

    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=dropout
    )
    devices = [model.lm_head.weight.device] if model.lm_head.weight.is_cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    # fp32 adapters beside a 16-bit base (peft's get_peft_model does the same): AdamW steps of
    # lr ~1e-5 on weights ~1e-2 are below bf16's resolution and would round away
    for name, param in model.named_parameters():
        if ".lora_" in name and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()
    return model


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


def merge_lora_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]], scalings: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Fold LoRA into the base weights, ``W + scale · B @ A``, under the plain HF names.

    Takes full (unsharded) tensors with peft's names in ``state_dict`` order (a LoRA layer
    lists ``base_layer.*`` then ``lora_A`` then ``lora_B``) and yields each merged weight as
    soon as its ``lora_B`` arrives, so a stream of gathered tensors never has to be held in
    full. Modules without adapters pass through unchanged.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        if ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            pending.setdefault(module, {})[leaf] = tensor
        elif ".lora_A." in name:
            pending.setdefault(name.split(".lora_A.")[0], {})["lora_A"] = tensor
        elif ".lora_B." in name:
            module = name.split(".lora_B.")[0]
            parts = pending.pop(module)
            base = parts["weight"]
            delta = scalings[module] * (tensor.float() @ parts["lora_A"].float())  # [out, in]
            yield f"{module}.weight", (base.float() + delta).to(base.dtype)
            if "bias" in parts:
                yield f"{module}.bias", parts["bias"]
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"LoRA layers without a lora_B weight: {sorted(pending)}")
