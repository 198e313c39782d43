"""DeepSeek-V3 (and R1, V3.1, Moonlight, Kimi-K2: one architecture; DeepSeek-V2 with its
softmax router, topk_method "greedy" or "group_limited_greedy"): multi-head latent
attention in every layer (models/mixers/mla.py), a dense SwiGLU MLP in the first
first_k_dense_replace layers, grouped-routed experts plus shared experts in the others
(models/mlps/grouped_experts.py).

config.json: ``q_lora_rank`` (null: q in one projection), ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rope_interleave``;
``n_routed_experts``, ``n_shared_experts``, ``n_group``, ``topk_group``,
``routed_scaling_factor``, ``norm_topk_prob``. ``num_key_value_heads`` does not shape MLA
(every head expands its own k and v from the latent) and is carried as given.
head_dim is qk_rope_head_dim, the dimensions RoPE turns (transformers sets it so too).

The published checkpoints append ``num_nextn_predict_layers`` multi-token-prediction layers
after the last decoder layer (``model.layers.61.*`` for V3); they serve speculative
decoding and are not loaded. The published V3, R1 and Kimi-K2 weights are FP8 with block
scales (``quantization_config``): they load dequantised to the model's dtype
(checkpoint_io/quantized_checkpoint.py). On disk each routed expert is its own tensors
under ``mlp.experts.{e}`` (expert_checkpoint.py).
"""

from __future__ import annotations

import re
from typing import Any

from hybridflow.models.layer_spec import LayerSpec

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM"}  # fmt: skip
V2 = "deepseek_v2"
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
MODEL_TYPES = tuple(ARCHITECTURES)
PER_EXPERT_NAMES = {
    model_type: ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    for model_type in MODEL_TYPES
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """head_dim is the rotated width (the published configs do not write it); Kimi-K2's
    ``kimi_k2`` is DeepSeek-V3's architecture under another name (what we write says
    deepseek_v3, which transformers builds without remote code)."""
    head_dim = int(hf.get("qk_rope_head_dim") or hf.get("head_dim") or 64)
    model_type = V2 if hf.get("model_type") == V2 else "deepseek_v3"
    return {**hf, "model_type": model_type, "head_dim": head_dim}


def read_tensor(arch, name: str, tensor) -> list[tuple[str, Any]]:
    """A checkpoint tensor -> [(our name, tensor)]; [] for the multi-token-prediction layers
    (index >= num_hidden_layers)."""
    match = _LAYER.match(name)
    if match and int(match.group(1)) >= arch.num_hidden_layers:
        return []
    return [(name, tensor)]


def not_loaded_note(hf: dict[str, Any], skipped: list[str]) -> str | None:
    """The line a load prints about the tensors ``skipped`` (the multi-token-prediction
    layers)."""
    layers = sorted({int(m.group(1)) for m in map(_LAYER.match, skipped) if m})
    if not layers:
        return None
    named = ", ".join(f"model.layers.{i}.*" for i in layers)
    return (
        f"its multi-token-prediction layer(s) {named} ({len(skipped)} tensors) are skipped: "
        "they serve speculative decoding, which hybridflow does not use"
    )


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    q_lora_rank = hf.get("q_lora_rank")
    v2 = hf.get("model_type") == V2
    return {
        # V2 turns its rope pairs as complex numbers: interleaved, like V3's checkpoints
        "rope_interleave": True if v2 else bool(hf.get("rope_interleave", True)),
        "topk_method": str(hf.get("topk_method") or "greedy") if v2 else "noaux_tc",
        # V2's router never renormalises (transformers' neither), whatever norm_topk_prob says
        "norm_topk_prob": False if v2 else bool(hf.get("norm_topk_prob", True)),
        "attention_bias": bool(hf.get("attention_bias", False)),
        "o_proj_bias": bool(hf.get("attention_bias", False)),
        "q_lora_rank": None if q_lora_rank is None else int(q_lora_rank),
        "kv_lora_rank": int(hf["kv_lora_rank"]),
        "qk_nope_head_dim": int(hf["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(hf["qk_rope_head_dim"]),
        "v_head_dim": int(hf["v_head_dim"]),
        "num_experts": int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size") or 0),
        "n_shared_experts": int(hf.get("n_shared_experts") or 0),
        "n_group": int(hf.get("n_group") or 1),
        "topk_group": int(hf.get("topk_group") or 1),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "first_k_dense_replace": int(hf.get("first_k_dense_replace") or 0),
        "router_aux_loss_coef": 0.0,  # balanced by the correction bias, not a loss
    }


def fields_to_hf(arch) -> dict[str, Any]:
    if arch.model_type == V2:
        return {**_shared_fields_to_hf(arch), "topk_method": arch.topk_method}
    return {**_shared_fields_to_hf(arch), "rope_interleave": arch.rope_interleave,
            "num_nextn_predict_layers": 0}  # fmt: skip


def _shared_fields_to_hf(arch) -> dict[str, Any]:
    return {
        "attention_bias": arch.attention_bias,
        "q_lora_rank": arch.q_lora_rank,
        "kv_lora_rank": arch.kv_lora_rank,
        "qk_nope_head_dim": arch.qk_nope_head_dim,
        "qk_rope_head_dim": arch.qk_rope_head_dim,
        "v_head_dim": arch.v_head_dim,
        "n_routed_experts": arch.num_experts,
        "num_experts_per_tok": arch.num_experts_per_tok,
        "moe_intermediate_size": arch.moe_intermediate_size,
        "n_shared_experts": arch.n_shared_experts,
        "n_group": arch.n_group,
        "topk_group": arch.topk_group,
        "routed_scaling_factor": arch.routed_scaling_factor,
        "norm_topk_prob": arch.norm_topk_prob,
        "first_k_dense_replace": arch.first_k_dense_replace,
        "output_router_logits": False,
    }


def layer_specs(arch) -> list[LayerSpec]:
    sparse_from = arch.first_k_dense_replace if arch.num_experts else arch.num_hidden_layers
    return [
        LayerSpec("mla", "grouped_experts_shared" if i >= sparse_from else "dense")
        for i in range(arch.num_hidden_layers)
    ]


def check(arch) -> None:
    dims = {"kv_lora_rank": arch.kv_lora_rank, "qk_rope_head_dim": arch.qk_rope_head_dim,
            "v_head_dim": arch.v_head_dim}  # fmt: skip
    bad = [f"{key}={value}" for key, value in dims.items() if value <= 0]
    if arch.q_lora_rank is not None and arch.q_lora_rank <= 0:
        bad.append(f"q_lora_rank={arch.q_lora_rank} (null for q in one projection)")
    if arch.qk_nope_head_dim < 0 or arch.qk_rope_head_dim % 2:
        bad.append(f"qk_nope_head_dim={arch.qk_nope_head_dim}, qk_rope_head_dim even")
    if bad:
        raise ValueError(f"multi-head latent attention needs positive sizes: {', '.join(bad)}")
    if arch.topk_method not in TOPK_METHODS or (
        (arch.topk_method == "noaux_tc") != (arch.model_type != V2)
    ):
        raise ValueError(f"topk_method {arch.topk_method!r} is not one this router runs for "
                         f"{arch.model_type} (V3: noaux_tc; V2: greedy, group_limited_greedy)")  # fmt: skip
    if not arch.num_experts:
        return
    from hybridflow.models.families.qwen3_moe import check_experts

    check_experts(arch)
    if arch.n_group < 1 or arch.num_experts % arch.n_group:
        raise ValueError(
            f"n_routed_experts={arch.num_experts} must split into n_group={arch.n_group} groups"
        )
    if not 1 <= arch.topk_group <= arch.n_group:
        raise ValueError(f"topk_group={arch.topk_group} must be in 1..n_group={arch.n_group}")
    if arch.num_experts_per_tok > arch.topk_group * (arch.num_experts // arch.n_group):
        raise ValueError(
            f"num_experts_per_tok={arch.num_experts_per_tok} exceeds the experts of "
            f"topk_group={arch.topk_group} groups"
        )


def mla_parameters(config) -> int:
    """Weights of one MLA mixer (matches the module's parameter count)."""
    h, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    rank, latent = config.q_lora_rank, config.kv_lora_rank
    q = h * heads * qk if rank is None else h * rank + bias * rank + rank + rank * heads * qk
    kv_a = h * (latent + config.qk_rope_head_dim) + bias * (latent + config.qk_rope_head_dim)
    kv_b = latent * heads * (config.qk_nope_head_dim + config.v_head_dim)
    o = heads * config.v_head_dim * h + bias * h
    return q + kv_a + latent + kv_b + o
