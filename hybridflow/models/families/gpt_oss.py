"""GPT-OSS (20B, 120B): attention with a sink logit per head, sliding-window (128 tokens) and
full layers alternating as ``layer_types`` says (models/mixers/sink_attention.py), and in
every layer a router with a bias over experts with biases and a clamped SwiGLU
(models/mlps/biased_experts.py). q/k/v/o carry biases; RoPE is YaRN.

config.json: ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` (each
expert's width), ``sliding_window``, ``layer_types`` ("sliding_attention" /
"full_attention"), ``swiglu_alpha``/``swiglu_limit`` (absent: 1.702 and 7.0).

The released checkpoints store the experts in MXFP4 (``*_blocks`` and ``*_scales`` tensors,
``quantization_config.quant_method = "mxfp4"``); they load dequantised to the model's dtype
(checkpoint_io/quantized_checkpoint.py).
"""

from __future__ import annotations

from typing import Any

from hybridflow.models.layer_spec import LayerSpec

ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
MODEL_TYPES = tuple(ARCHITECTURES)
WINDOWED = "sliding_attention"
LAYER_TYPES = (WINDOWED, "full_attention")


def layer_types_of(hf: dict[str, Any]) -> tuple[str, ...]:
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    return tuple(  # transformers' default: sliding first, then alternating
        WINDOWED if i % 2 == 0 else "full_attention" for i in range(int(hf["num_hidden_layers"]))
    )


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "layer_types": layer_types_of(hf),
        "attention_window": int(hf.get("sliding_window") or 0),
        "num_experts": int(hf.get("num_local_experts") or hf.get("num_experts") or 0),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(hf["intermediate_size"]),
        "norm_topk_prob": True,  # a softmax over the chosen logits sums to 1
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0),
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
    }


def fields_to_hf(arch) -> dict[str, Any]:
    return {
        "attention_bias": arch.attention_bias,
        "layer_types": list(arch.layer_types),
        "sliding_window": arch.attention_window,
        "num_local_experts": arch.num_experts,
        "num_experts_per_tok": arch.num_experts_per_tok,
        "intermediate_size": arch.moe_intermediate_size,
        "router_aux_loss_coef": arch.router_aux_loss_coef,
        "swiglu_alpha": arch.swiglu_alpha,
        "swiglu_limit": arch.swiglu_limit,
        "output_router_logits": False,
    }


def layer_specs(arch) -> list[LayerSpec]:
    return [
        LayerSpec(
            "sink_attention", "biased_experts", arch.attention_window if kind == WINDOWED else 0
        )  # fmt: skip
        for kind in arch.layer_types
    ]


def check(arch) -> None:
    if len(arch.layer_types) != arch.num_hidden_layers:
        raise ValueError(
            f"layer_types names {len(arch.layer_types)} layers, num_hidden_layers is "
            f"{arch.num_hidden_layers}"
        )
    unknown = sorted(set(arch.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not one of {list(LAYER_TYPES)}")
    if WINDOWED in arch.layer_types and arch.attention_window <= 0:
        raise ValueError("sliding_attention layers need sliding_window > 0")
    from hybridflow.models.families.qwen3_moe import check_experts

    check_experts(arch)
