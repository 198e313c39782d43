"""Shape and numerics of one Llama-family decoder, with Hugging Face config.json conversion."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from hybridflow.model_config_values import SUPPORTED_MODEL_TYPES, check_config_values

# Families whose MLP is a sparse mixture of experts (models/moe.py) on some or all layers.
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")

# rope_scaling types rope.py implements (HF names; "type" is the legacy key for "rope_type").
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


@dataclass
class ModelArchitecture:
    """Everything the decoder needs to know about its shape; field names follow HF config.json."""

    model_type: str = "llama"
    """One of SUPPORTED_MODEL_TYPES."""
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    """Width of the SwiGLU MLP (gate/up projections)."""
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    """Fewer than num_attention_heads means grouped-query attention."""
    head_dim: int = 128
    """Qwen3 sets this independently of hidden_size // num_attention_heads."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """HF format, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None = plain RoPE."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    """lm_head shares the input embedding matrix."""
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2/2.5 always; Llama applies it to o_proj as well)."""
    qk_norm: bool = False
    """Qwen3: per-head RMSNorm on q and k before RoPE."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    o_proj_bias: bool = False
    """Bias on o_proj (HF Llama with attention_bias=True). Derived by from_hf."""
    sliding_window: int | None = None
    """Mistral's window. Attention here is full-causal, which equals the sliding window for
    sequences up to this length; longer ones raise (use the HF fallback)."""
    torch_dtype: str | None = None
    """dtype named in config.json (informational; load_model's dtype argument decides)."""
    num_experts: int = 0
    """Experts per sparse layer (qwen3_moe, mixtral); 0 = a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Width of each expert's SwiGLU MLP (Mixtral's intermediate_size)."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing weights to sum to 1 (Mixtral always does)."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP of intermediate_size among the sparse ones."""
    router_aux_loss_coef: float = 0.0
    """Load-balancing loss coefficient from config.json (the trainer may override it)."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}; "
                "load it with load_model(..., backend='hf') instead"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)
        self._check_experts()
        if self.rope_scaling is not None:
            rope_type = self.rope_type
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling type {rope_type!r} is not one of {SUPPORTED_ROPE_TYPES}; "
                    "load this model with load_model(..., backend='hf')"
                )

    def _check_experts(self) -> None:
        if self.model_type not in MOE_MODEL_TYPES and self.num_experts:
            raise ValueError(f"model_type={self.model_type!r} has no experts")
        if not self.num_experts:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                f"{self.num_experts}"
            )
        if self.moe_intermediate_size <= 0 or self.decoder_sparse_step < 1:
            raise ValueError("moe_intermediate_size and decoder_sparse_step must be positive")
        if self.model_type == "mixtral" and not (
            self.norm_topk_prob and self.decoder_sparse_step == 1 and not self.mlp_only_layers
        ):
            raise ValueError("mixtral routes every layer and always renormalises its top-k")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, index: int) -> bool:
        """Layer ``index`` holds a mixture of experts (HF's Qwen3MoeDecoderLayer rule)."""
        return (
            self.is_moe
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    def sparse_layer_indices(self) -> list[int]:
        """Layers with experts, in order: the L axis of routed_experts [.., L, k]."""
        return [i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i)]

    def mlp_parameters(self, active: bool = False) -> int:
        """Weights of every layer's MLP: SwiGLU matrices of the dense layers, router and
        experts of the sparse ones (active: the top-k experts one token runs through)."""
        h, sparse = self.hidden_size, len(self.sparse_layer_indices())
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = self.num_experts * h + experts * 3 * h * self.moe_intermediate_size
        return sparse * moe + (self.num_hidden_layers - sparse) * 3 * h * self.intermediate_size

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def num_parameters(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Parameter count from the shapes (matches sum(p.numel()) of CausalLM).

        active: count only the experts one token runs through (top-k of each sparse layer)."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.o_proj_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * hd
        per_layer = attn + 2 * h
        total = self.num_hidden_layers * per_layer + h  # + final norm
        total += self.mlp_parameters(active)
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelArchitecture:
        """Build from the content of a HF config.json (transformers 4.x and 5.x layouts);
        ModelConfigError naming ``source`` (the file) for a value no model can have."""
        check_config_values(hf, source)
        model_type = hf.get("model_type")
        heads = hf["num_attention_heads"]
        rope_theta = hf.get("rope_theta")
        rope_scaling = copy.deepcopy(hf.get("rope_scaling"))
        # transformers 5 moves theta and scaling into "rope_parameters".
        rope_parameters = hf.get("rope_parameters")
        if isinstance(rope_parameters, dict) and rope_parameters:
            params = dict(rope_parameters)
            rope_theta = params.pop("rope_theta", rope_theta)
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_scaling is None and rope_type != "default":
                rope_scaling = params
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type == "default":
                rope_scaling = None
        attention_bias = bool(hf.get("attention_bias", False))
        o_proj_bias = attention_bias
        if model_type == "qwen2":  # Qwen2 hardcodes bias on q/k/v and none on o_proj
            attention_bias, o_proj_bias = True, False
        elif model_type in ("mistral", "mixtral"):
            attention_bias, o_proj_bias = False, False
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            o_proj_bias=o_proj_bias,
            sliding_window=sliding,
            torch_dtype=hf.get("torch_dtype", hf.get("dtype")),
            **_experts_from_hf(hf),
        )

    def to_hf(self) -> dict[str, Any]:
        """Content of a HF config.json that transformers (4.x and 5.x) loads as the same model."""
        if self.model_type == "qwen2" and (not self.attention_bias or self.o_proj_bias):
            raise ValueError("qwen2 checkpoints always have q/k/v bias and no o_proj bias")
        if self.model_type == "llama" and self.attention_bias != self.o_proj_bias:
            raise ValueError("llama's attention_bias covers q/k/v and o_proj together")
        if self.model_type == "mistral" and (self.attention_bias or self.o_proj_bias):
            raise ValueError("mistral has no attention bias")
        if self.model_type == "mixtral" and (self.attention_bias or self.o_proj_bias):
            raise ValueError("mixtral has no attention bias")
        if self.model_type not in ("qwen3", "qwen3_moe") and self.qk_norm:
            raise ValueError("qk_norm is only expressible as model_type='qwen3' or 'qwen3_moe'")
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
            rope_parameters.setdefault("rope_type", self.rope_type)
        hf: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": copy.deepcopy(self.rope_scaling),
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": self.torch_dtype or "float32",
        }
        if self.model_type in ("llama", "qwen3", "qwen3_moe"):
            hf["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = False
        if self.model_type in ("mistral", "qwen2", "qwen3", "qwen3_moe"):
            hf["sliding_window"] = self.sliding_window
            hf["use_sliding_window"] = False
        if self.model_type == "mixtral":
            hf["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            hf["max_window_layers"] = self.num_hidden_layers
        hf.update(self._experts_to_hf())
        return hf

    def _experts_to_hf(self) -> dict[str, Any]:
        if self.model_type == "qwen3_moe":
            return {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "output_router_logits": False,
            }
        if self.model_type == "mixtral":
            return {
                "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "intermediate_size": self.moe_intermediate_size,
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "router_jitter_noise": 0.0,
                "output_router_logits": False,
            }
        return {}

    def replace(self, **changes: Any) -> ModelArchitecture:
        return dataclasses.replace(self, **changes)


def _experts_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe or mixtral config.json ({} otherwise).

    transformers 5 writes Qwen3-MoE's expert count as num_local_experts (its attribute map),
    the published checkpoints as num_experts: both are read."""
    model_type = hf.get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        return {}
    fields = {
        "num_experts": int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 0)),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0),
    }
    if model_type == "mixtral":
        return {**fields, "moe_intermediate_size": hf["intermediate_size"], "norm_topk_prob": True}
    return {
        **fields,
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
    }
