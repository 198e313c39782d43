"""The dense Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k-norm).

Every layer is GQA attention with RoPE and a SwiGLU MLP. What differs between the members is
which projections carry a bias, whether q/k are normalised and Mistral's window; this file
reads those from config.json and writes them back.
"""

from __future__ import annotations

from typing import Any

from hybridflow.models.layer_spec import LayerSpec

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
MODEL_TYPES = tuple(ARCHITECTURES)

# Members whose attention normalises q and k per head (this family's and the MoE one's).
QK_NORM_TYPES = ("qwen3", "qwen3_moe")


def layer_specs(arch) -> list[LayerSpec]:
    return [LayerSpec("attention", "dense")] * arch.num_hidden_layers


def attention_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Bias, q/k-norm and window fields of a Llama-shaped attention from config.json (shared
    with the mixture-of-experts members, families/qwen3_moe.py)."""
    model_type = hf.get("model_type")
    attention_bias = bool(hf.get("attention_bias", False))
    o_proj_bias = attention_bias
    if model_type == "qwen2":  # Qwen2 hardcodes bias on q/k/v and none on o_proj
        attention_bias, o_proj_bias = True, False
    elif model_type in ("mistral", "mixtral"):
        attention_bias, o_proj_bias = False, False
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    return {
        "attention_bias": attention_bias,
        "o_proj_bias": o_proj_bias,
        "qk_norm": model_type in QK_NORM_TYPES,
        "sliding_window": sliding,
    }


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return attention_fields(hf)


def check_expressible(arch) -> None:
    """Raise when ``arch`` cannot be written as a config.json of its model_type."""
    model_type = arch.model_type
    if model_type == "qwen2" and (not arch.attention_bias or arch.o_proj_bias):
        raise ValueError("qwen2 checkpoints always have q/k/v bias and no o_proj bias")
    if model_type == "llama" and arch.attention_bias != arch.o_proj_bias:
        raise ValueError("llama's attention_bias covers q/k/v and o_proj together")
    if model_type in ("mistral", "mixtral") and (arch.attention_bias or arch.o_proj_bias):
        raise ValueError(f"{model_type} has no attention bias")
    if model_type not in QK_NORM_TYPES and arch.qk_norm:
        raise ValueError("qk_norm is only expressible as model_type='qwen3' or 'qwen3_moe'")


def fields_to_hf(arch) -> dict[str, Any]:
    """config.json entries of this member beyond the common ones."""
    check_expressible(arch)
    model_type = arch.model_type
    hf: dict[str, Any] = {}
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        hf["attention_bias"] = arch.attention_bias
    if model_type == "llama":
        hf["mlp_bias"] = False
    if model_type in ("mistral", "qwen2", "qwen3", "qwen3_moe"):
        hf["sliding_window"] = arch.sliding_window
        hf["use_sliding_window"] = False
    if model_type == "mixtral":
        hf["sliding_window"] = arch.sliding_window
    if model_type in ("qwen2", "qwen3"):
        hf["max_window_layers"] = arch.num_hidden_layers
    return hf


def check(arch) -> None:
    if arch.num_experts:
        raise ValueError(f"model_type={arch.model_type!r} has no experts")
