"""The Llama family with a sparse mixture of experts: Qwen3-MoE and Mixtral.

Attention as in families/llama.py; the MLP of a sparse layer is a softmax top-k router over
SwiGLU experts (models/moe.py). Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and
i is not in mlp_only_layers (HF's Qwen3MoeDecoderLayer rule); Mixtral routes every layer.
On disk each expert is its own tensors, named per member (expert_checkpoint.py).
"""

from __future__ import annotations

from typing import Any

from hybridflow.models.families import llama
from hybridflow.models.layer_spec import LayerSpec

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
MODEL_TYPES = tuple(ARCHITECTURES)

# member -> (module name on disk, {part: per-expert projection name})
PER_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def is_sparse_layer(arch, index: int) -> bool:
    return (
        arch.num_experts > 0
        and index not in arch.mlp_only_layers
        and (index + 1) % arch.decoder_sparse_step == 0
    )


def layer_specs(arch) -> list[LayerSpec]:
    return [
        LayerSpec("attention", "experts" if is_sparse_layer(arch, i) else "dense")
        for i in range(arch.num_hidden_layers)
    ]


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {**llama.attention_fields(hf), **experts_from_hf(hf)}


def experts_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe or mixtral config.json.

    transformers 5 writes Qwen3-MoE's expert count as num_local_experts (its attribute map),
    the published checkpoints as num_experts: both are read."""
    fields = {
        "num_experts": int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 0)),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0),
    }
    if hf.get("model_type") == "mixtral":
        return {**fields, "moe_intermediate_size": hf["intermediate_size"], "norm_topk_prob": True}
    return {
        **fields,
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
    }


def fields_to_hf(arch) -> dict[str, Any]:
    hf = llama.fields_to_hf(arch)
    if arch.model_type == "qwen3_moe":
        hf.update(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
            moe_intermediate_size=arch.moe_intermediate_size,
            norm_topk_prob=arch.norm_topk_prob,
            decoder_sparse_step=arch.decoder_sparse_step,
            mlp_only_layers=list(arch.mlp_only_layers),
            router_aux_loss_coef=arch.router_aux_loss_coef,
            output_router_logits=False,
        )
    else:
        hf.update(
            num_local_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
            intermediate_size=arch.moe_intermediate_size,
            router_aux_loss_coef=arch.router_aux_loss_coef,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
    return hf


def check(arch) -> None:
    """The expert fields of ``arch`` describe a router our MoE block runs."""
    if not arch.num_experts:
        return
    check_experts(arch)
    if arch.model_type == "mixtral" and not (
        arch.norm_topk_prob and arch.decoder_sparse_step == 1 and not arch.mlp_only_layers
    ):
        raise ValueError("mixtral routes every layer and always renormalises its top-k")


def check_experts(arch) -> None:
    if not 0 < arch.num_experts_per_tok <= arch.num_experts:
        raise ValueError(
            f"num_experts_per_tok={arch.num_experts_per_tok} must be in 1..num_experts="
            f"{arch.num_experts}"
        )
    if arch.moe_intermediate_size <= 0 or arch.decoder_sparse_step < 1:
        raise ValueError("moe_intermediate_size and decoder_sparse_step must be positive")
