"""LoRA adapters through peft, injected into our own CausalLM (no PeftModel wrapper).

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` by a LoRA layer that
holds the original as ``base_layer`` and freezes every base weight. Parameter names become
``...q_proj.base_layer.weight`` and ``...q_proj.lora_A.default.weight``; :func:`merge_lora_stream`
folds the adapters back into plain HF names for export.

A mixture of experts keeps its experts in packed 3-D tensors, which peft does not adapt
without materialising W + BA for every expert at every forward. Targeting gate_proj, up_proj
or down_proj (or ``experts``) gives each expert its own rank-r factors instead
(models/moe.ExpertLoRA: ``...mlp.experts.lora.gate_up_A [E, r, H]`` and friends), applied as
two more grouped GEMMs per projection; the router is not adapted, and LoRA dropout does not
apply to the experts. GPT-OSS's biased experts (stored [E, in, out]) get theirs the same way;
their biases stay frozen, as peft's bias="none" leaves a linear layer's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hybridflow.models.layer_spec import lora_target_modules
from hybridflow.models.mlps.biased_experts import BiasedExperts
from hybridflow.models.moe import ExpertLoRA, Experts

ADAPTER = "default"
# Target names that adapt a mixture of experts' experts (both packed projections).
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj", "experts")


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

    experts = [m for m in model.modules() if isinstance(m, (Experts, BiasedExperts))]
    layer_specs = getattr(getattr(model, "config", None), "layer_specs", None)
    if layer_specs is not None:  # attention's names -> each mixer kind's own projections
        target_modules = lora_target_modules(layer_specs(), target_modules)
    linear_names = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    # peft gets the linear layers; an MLP name only the experts have is theirs alone
    linear_targets = [
        t for t in target_modules if t in linear_names or not (experts and t in EXPERT_TARGETS)
    ]
    if linear_targets:
        # the language model only: a vision encoder's MLP shares its projection names
        vision = getattr(model, "visual", None) is not None and not experts
        config = peft.LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=linear_targets,
            lora_dropout=dropout,
            exclude_modules=r"visual\..*" if vision else None,
        )
        devices = [model.lm_head.weight.device] if model.lm_head.weight.is_cuda else []
        # peft rewrites the targets of a model whose config names a transformers MoE type
        # (gate_proj -> a ParamWrapper around the packed experts); the decoder stack has no
        # config, so peft adapts its linear layers only and the experts get ours below
        target = model.model if experts else model
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            peft.inject_adapter_in_model(config, target, adapter_name=ADAPTER)
    for name, param in model.named_parameters():  # the base is frozen (peft's bias="none")
        if ".lora_" not in name:
            param.requires_grad_(False)
    # fp32 adapters beside a 16-bit base (peft's get_peft_model does the same): AdamW steps of
    # lr ~1e-5 on weights ~1e-2 are below bf16's resolution and would round away
    for name, param in model.named_parameters():
        if ".lora_" in name and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()
    if experts and any(t in EXPERT_TARGETS for t in target_modules):
        generator = torch.Generator(device=experts[0].gate_up_proj.device).manual_seed(seed + 1)
        for module in experts:  # fp32, trainable; created after peft froze the rest
            module.lora = ExpertLoRA(module, rank, alpha, generator)
    return model


def lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def expert_adapters(model: nn.Module) -> list[ExpertLoRA]:
    return [m for m in model.modules() if isinstance(m, ExpertLoRA)]


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model) or expert_adapters(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model: every LoRA layer returns ``base_layer(x)`` inside the block.

    Sets peft's ``_disable_adapters`` flag directly: peft's public ``enable_adapters(False)``
    also flips ``requires_grad`` of the adapter weights, which must not change under FSDP.
    """
    layers, experts = lora_layers(model), expert_adapters(model)
    previous = [layer._disable_adapters for layer in layers]
    previous_experts = [adapters.disabled for adapters in experts]
    for layer in layers:
        layer._disable_adapters = True
    for adapters in experts:
        adapters.disabled = True
    try:
        yield
    finally:
        for layer, flag in zip(layers, previous):
            layer._disable_adapters = flag
        for adapters, flag in zip(experts, previous_experts):
            adapters.disabled = flag


def lora_scalings(model: nn.Module, prefix_to_strip: str = "") -> dict[str, float]:
    """Module name (HF naming, without ``prefix_to_strip``) -> LoRA scale alpha / r."""
    scalings = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER in scaling:
            scalings[name.removeprefix(prefix_to_strip)] = float(scaling[ADAPTER])
        elif isinstance(module, ExpertLoRA):  # "...mlp.experts.lora"
            scalings[name.removeprefix(prefix_to_strip)] = module.scale
    return scalings


def merge_lora_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]], scalings: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Fold LoRA into the base weights, ``W + scale · B @ A``, under the plain HF names.

    Takes full (unsharded) tensors with peft's names in ``state_dict`` order (a LoRA layer
    lists ``base_layer.*`` then ``lora_A`` then ``lora_B``) and yields each merged weight as
    soon as its ``lora_B`` arrives, so a stream of gathered tensors never has to be held in
    full. Modules without adapters pass through unchanged.

    Each weight is merged on its base's device: the adapters may live elsewhere (their fp32
    host masters under actor.optimizer_offload, beside a base on the GPU), and the rank-r
    factors are what moves, not the full-size product.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        module, _, leaf = name.rpartition(".")
        if f"{module}.lora" in scalings or ".experts.lora." in name:  # per-expert adapters
            yield from _merge_expert_tensor(pending, name, tensor, scalings)
        elif ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            pending.setdefault(module, {})[leaf] = tensor
        elif ".lora_A." in name:
            pending.setdefault(name.split(".lora_A.")[0], {})["lora_A"] = tensor
        elif ".lora_B." in name:
            module = name.split(".lora_B.")[0]
            parts = pending.pop(module)
            base = parts["weight"]
            yield f"{module}.weight", merged(base, tensor, parts["lora_A"], scalings[module])
            if "bias" in parts:
                yield f"{module}.bias", parts["bias"]
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"LoRA layers without a lora_B weight: {sorted(pending)}")


def _merge_expert_tensor(
    pending: dict[str, dict[str, torch.Tensor]],
    name: str,
    tensor: torch.Tensor,
    scalings: dict[str, float],
) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor of an adapted ``...mlp.experts`` module (state-dict order: gate_up_proj,
    down_proj (GPT-OSS: each followed by its bias), then lora.gate_up_A/B, lora.down_A/B):
    each packed tensor leaves merged, W_e + scale * B_e @ A_e, once its B arrives."""
    if ".experts.lora." in name:
        adapters, leaf = name.rsplit(".", 1)  # "...experts.lora", "gate_up_A"
        experts = adapters.removesuffix(".lora")
        projection, factor = leaf.rsplit("_", 1)
        if factor == "A":
            pending.setdefault(f"{adapters}.{projection}", {})["A"] = tensor
            return
        base_name = f"{experts}.{projection}_proj"
        base = pending.pop(base_name)["weight"]
        lora_a = pending.pop(f"{adapters}.{projection}")["A"]
        yield base_name, merged(base, tensor, lora_a, scalings[adapters])
        return
    if not name.endswith(("gate_up_proj", "down_proj")):  # GPT-OSS's expert biases: as they are
        yield name, tensor
        return
    pending.setdefault(name, {})["weight"] = tensor


def merged(
    base: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor, scale: float
) -> torch.Tensor:
    """``base + scale · B @ A`` in the base's dtype, computed in fp32 on the base's device
    (B [out, r] and A [r, in], or [E, out, r] and [E, r, in] for packed experts). One fp32
    product is the only full-size temporary: the base is added into it in place."""
    device = base.device
    delta = torch.matmul(lora_b.to(device, torch.float32), lora_a.to(device, torch.float32))
    return delta.mul_(scale).add_(base).to(base.dtype)
