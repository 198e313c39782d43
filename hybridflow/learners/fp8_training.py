"""FP8 training matmuls (actor.precision=fp8, critic.precision=fp8) through torchao's float8
training (``torchao.float8.convert_to_float8_training``, the optional extra ``fp8``).

What computes in FP8: the ``nn.Linear`` projections inside the decoder layers (attention
q/k/v/o, the MLP's gate/up/down, a linear-attention mixer's projections) whose two dims are
multiples of 16 (the FP8 tensor cores' tile). Each becomes torchao's ``Float8Linear``: the
input and the weight are cast to float8 e4m3 with dynamic scales (per tensor, or per row with
``rowwise``) in front of each of the three matmuls (output, grad-input, grad-weight); the
gradient is e5m2 under ``tensorwise`` (torchao's default there) and e4m3 under ``rowwise``.
What stays bf16: the embedding, the LM head (the log-prob head reads its weight directly), a
mixture of experts' router and grouped experts (nn.Parameters, not Linears), the value head,
the vision tower, LoRA's adapters (rank-sized dims), the norms and attention.

The parameters stay as they were (``Float8Linear`` subclasses ``nn.Linear``, same names, same
fp32 or bf16 ``weight``): masters and AdamW state are unchanged, a checkpoint of an fp8 run
loads into a bf16 one and back, and the rollout reads the same tensors. One exception, under
FSDP2 with ``tensorwise``: the sharded weights are wrapped in torchao's
``WeightWithDynamicFloat8CastTensor`` so FSDP all-gathers them in float8 (half the bytes);
:func:`plain_tensor` unwraps them (and dequantizes an all-gathered float8 weight) for weight
sync and export.

LoRA: the base layers (frozen) compute in FP8 too; torchao's backward still computes the
frozen weight's gradient (it does not look at which inputs need one) and autograd drops it,
so one of the three FP8 matmuls of a base layer is wasted.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.config.precision_checks import FP8_RECIPES, PRECISIONS

MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have float8 tensor cores
FP8_TILE = 16  # torch._scaled_mm needs both dims of each operand divisible by 16
# Leaf names of Linears that route tokens (a mixture of experts' router, as transformers
# names it): a routing flip from FP8 rounding moves whole tokens between experts.
ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})


@dataclass(frozen=True)
class Fp8Training:
    """How the decoder's linears compute in FP8.

    recipe: rowwise (a scale per row of each operand: torchao's more accurate recipe) or
        tensorwise (one scale per tensor: the fastest, and the one whose weights FSDP2 can
        all-gather in float8).
    emulate: torchao's emulation (float8 rounding, matmuls in high precision), which runs on
        the CPU: for tests only, it is slower than bf16."""

    recipe: str = "rowwise"
    emulate: bool = False


def fp8_device_problem(device: torch.device, emulate: bool = False) -> str | None:
    """Why FP8 training cannot run on ``device`` (None: it can)."""
    if emulate:
        return None
    if device.type != "cuda":
        return (f"FP8 training needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper "
                f"or newer), and this role trains on {device}")  # fmt: skip
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"FP8 training needs compute capability >= 8.9 (float8 tensor cores), and "
                f"{device} ({name}) has {capability[0]}.{capability[1]}")  # fmt: skip
    return None


def check_fp8_device(device: torch.device, emulate: bool, key: str) -> None:
    """UserError (exit 2) naming ``key`` unless FP8 training can run on ``device``."""
    from hybridflow.errors import UserError

    problem = fp8_device_problem(device, emulate)
    if problem is not None:
        raise UserError(f"{key} = fp8: {problem}", fix=f"set {key}=bf16, or train on an H100/H200")


def fp8_options(
    precision: str, recipe: str, device: torch.device | str, *, emulate: bool, key: str
) -> Fp8Training | None:
    """The FP8 training of a role whose config says ``key = precision`` (None: bf16), after
    checking that ``device`` can run it."""
    if precision == "bf16":
        return None
    if precision != "fp8" or recipe not in FP8_RECIPES:
        raise ValueError(f"{key} = {precision!r} with fp8_recipe {recipe!r}: use precision "
                         f"{' or '.join(PRECISIONS)}, fp8_recipe {' or '.join(FP8_RECIPES)}")  # fmt: skip
    check_fp8_device(torch.device(device), emulate, key)
    return Fp8Training(recipe=recipe, emulate=emulate)


def import_torchao_float8():
    """torchao.float8, or a UserError saying how to install it."""
    from hybridflow.errors import UserError
    from hybridflow.install_hint import extra_install

    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise UserError(
            f"FP8 training uses torchao's float8 training, which is not installed ({error})",
            fix=f"install it: {extra_install('fp8')}, or set actor.precision=bf16",
        ) from error
    return float8


def fp8_linear_names(lm: nn.Module) -> list[str]:
    """Names (in ``lm``) of the Linears that compute in FP8: those inside the decoder layers,
    except routers, LoRA adapters and Linears with a dim that is not a multiple of 16."""
    from hybridflow.learners.modules import decoder_layers

    in_layers = {id(m) for layer in decoder_layers(lm) for m in layer.modules()}
    return [
        name
        for name, module in lm.named_modules()
        if id(module) in in_layers and _fp8_capable(name, module)
    ]


def _fp8_capable(name: str, module: nn.Module) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    parts = name.split(".")
    if parts[-1] in ROUTER_NAMES or any(part.startswith("lora_") for part in parts):
        return False
    out_features, in_features = module.weight.shape
    return out_features % FP8_TILE == 0 and in_features % FP8_TILE == 0


def float8_config(options: Fp8Training, *, fsdp: bool):
    """torchao's Float8LinearConfig of ``options.recipe``; under FSDP2 the tensorwise weights
    are all-gathered in float8 (torchao offers that for tensorwise scales only)."""
    float8 = import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(options.recipe)
    return dataclasses.replace(
        config,
        emulate=options.emulate,
        enable_fsdp_float8_all_gather=fsdp and options.recipe == "tensorwise",
    )


def convert_to_fp8(lm: nn.Module, options: Fp8Training, *, fsdp: bool) -> list[str]:
    """Swap the FP8-capable Linears of ``lm`` (see :func:`fp8_linear_names`) for torchao's
    Float8Linear (as fp8_linear.ComputeCopyFloat8Linear: the weight quantized from its bf16
    compute copy), in place, before FSDP2 shards it; returns their names."""
    float8 = import_torchao_float8()
    names = fp8_linear_names(lm)
    chosen = set(names)
    float8.convert_to_float8_training(
        lm,
        config=float8_config(options, fsdp=fsdp),
        module_filter_fn=lambda _module, fqn: fqn in chosen,
    )
    from hybridflow.learners.fp8_linear import ComputeCopyFloat8Linear

    for name in names:
        lm.get_submodule(name).__class__ = ComputeCopyFloat8Linear  # same state, its forward
    return names


def gathers_in_fp8(module: nn.Module) -> bool:
    """Whether FSDP2 all-gathers some of ``module``'s weights in float8 (then their scales are
    computed once whenever the weights change: :func:`precompute_weight_scales`)."""
    wrapper = _torchao_class("fsdp_utils", "WeightWithDynamicFloat8CastTensor")
    if wrapper is None:
        return False
    return any(isinstance(getattr(p, "_local_tensor", p), wrapper) for p in module.parameters())


@torch.no_grad()
def precompute_weight_scales(module: nn.Module, compute_dtype: torch.dtype | None) -> None:
    """The float8 scales of the FSDP2-sharded tensorwise weights, in one all-reduce for all of
    them, instead of one per layer at each forward: torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``, each amax rounded to ``compute_dtype``
    (FSDP2's param_dtype; None: fp32) first. Call it when the weights change (built, loaded,
    stepped).

    Why the rounding: the rollout receives each weight as the trainer's float8 bytes
    dequantized to bf16 (core.iter_unit_gathered) and quantizes it again with the trainer's
    recipe (engine/fp8/weight_scales.py), taking the amax of what it received. The amax
    element's byte is 448, so it receives 448 / s rounded to bf16: with s = 448 / amax of the
    fp32 master, that is within 2^-9 of amax, and the rollout's scale differs from the
    trainer's in its last bits; with s = 448 / bf16(amax) (the amax of the bf16 compute copy,
    the tensor a one-device trainer quantizes: fp8_linear.py) it is bf16(amax) exactly, so the
    rollout computes the trainer's s, and its bytes, e4m3(bf16(b / s) * s) = b, are the
    trainer's bytes b."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import EPS
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    linears = [
        m
        for m in module.modules()
        if isinstance(m, Float8Linear)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
    ]
    if not linears:
        return
    (target,) = {m.config.cast_config_weight.target_dtype for m in linears}
    amax = torch.stack(torch._foreach_norm([m.weight for m in linears], ord=math.inf))  # Partial
    amax = torch.clamp(amax, EPS)  # Replicate: the one all-reduce
    if compute_dtype is not None:
        amax = amax.to(compute_dtype)
    # float64 as torchao's amax_to_scale (its compiled and eager numerics agree)
    scales = (torch.finfo(target).max / amax.to(torch.float64)).to_local().to(torch.float32)
    for index, linear in enumerate(linears):
        linear.weight._local_tensor._precomputed_scale = scales[index]


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without torchao's float8 training subclasses: a wrapped weight's own
    (bf16/fp32) tensor, an all-gathered float8 weight dequantized to its original dtype;
    any other tensor as it is. DTensors are left to the caller (gather them first)."""
    if "torchao" not in sys.modules:  # nothing was converted: no subclass can exist
        return tensor
    wrapper = _torchao_class("fsdp_utils", "WeightWithDynamicFloat8CastTensor")
    if wrapper is not None and isinstance(tensor, wrapper):
        return tensor._tensor
    float8_tensor = _torchao_class("float8_training_tensor", "Float8TrainingTensor")
    if float8_tensor is not None and isinstance(tensor, float8_tensor):
        return tensor.to_original_precision()
    return tensor


def _torchao_class(module: str, name: str):
    """A class of torchao.float8 when torchao is already imported (None otherwise: then no
    instance of it can exist, and bf16 runs never import torchao)."""
    if "torchao" not in sys.modules:
        return None
    import importlib

    try:
        return getattr(importlib.import_module(f"torchao.float8.{module}"), name)
    except (ImportError, AttributeError):
        return None
