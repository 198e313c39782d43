"""Shape and numerics of one decoder, with Hugging Face config.json conversion.

The fields every family shares are read and written here; each family's own fields, checks
and layer specs are in its file (models/families/)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
from dataclasses import dataclass
from typing import Any

from hybridflow.model_config_values import check_config_values
from hybridflow.models.families import SUPPORTED_MODEL_TYPES, family_of, text_config
from hybridflow.models.layer_spec import LayerSpec
from hybridflow.models.vision.spec import VisionSpec

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArchitecture"]

# rope_scaling types rope.py implements (HF names; "type" is the legacy key for "rope_type").
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


_DERIVED = "_derived_values"
"""Where ModelArchitecture.derived keeps its values (outside the fields)."""


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
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert beside the routed ones (Qwen3.5-MoE); 0 = none."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dimensions RoPE turns (Qwen3.5: 0.25); the rest pass as is."""
    layer_types: tuple[str, ...] = ()
    """Hybrid families: HF's per-layer "linear_attention" / "full_attention" (Qwen3.5)."""
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    """Gated DeltaNet layers' conv kernel and key/value heads (value heads group over keys)."""
    zero_centered_norms: bool = False
    """RMSNorm weights stored as offsets from 1 (``x * (1 + w)``): Qwen3.5's layer norms."""
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    """Multi-head latent attention (DeepSeek): q through a q_lora_rank bottleneck (None: one
    projection), k/v expanded from a kv_lora_rank latent; each head's q and k are
    qk_nope_head_dim plain + qk_rope_head_dim rotated dimensions (head_dim is the latter)."""
    rope_interleave: bool = False
    """RoPE turns interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's checkpoints)."""
    topk_method: str = "noaux_tc"
    """DeepSeek's routing: "noaux_tc" (V3: sigmoid scores, a correction bias), "greedy" or
    "group_limited_greedy" (V2: softmax scores, the best expert of a group scores it)."""
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    """DeepSeek's router: sigmoid scores, top-k within the topk_group best of n_group expert
    groups, weights times routed_scaling_factor; n_shared_experts always-on experts of
    moe_intermediate_size each; the first first_k_dense_replace layers are dense."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    """GPT-OSS's experts: (up + 1) * gate * sigmoid(alpha * gate), both clamped at limit."""
    attention_window: int = 0
    """Tokens a sliding-window layer attends to (GPT-OSS's sliding_window, whose layers
    layer_types names); implemented, unlike Mistral's sliding_window above."""
    mrope_section: tuple[int, ...] = ()
    """Multimodal RoPE (Qwen2.5-VL): each head's frequency pairs cut into three sections,
    turned by the temporal, height and width position rows (models/mrope.py); () = RoPE."""
    mrope_interleaved: bool = False
    """Qwen3.5's mRoPE: the rows take turns pair by pair (models/mrope.py), not in blocks."""
    vision: VisionSpec | None = None
    """The vision encoder of a vision-language model (models/vision/); None = text only."""

    def __post_init__(self) -> None:
        family = family_of(self.model_type)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)
        self.layer_types = tuple(self.layer_types)
        self.mrope_section = tuple(int(s) for s in self.mrope_section)
        family.check(self)
        if self.rope_scaling is not None:
            rope_type = self.rope_type
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling type {rope_type!r} is not one of {SUPPORTED_ROPE_TYPES}; "
                    "load this model with load_model(..., backend='hf')"
                )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_specs(self) -> list[LayerSpec]:
        """What each layer is made of (its family's rule): ask these, not model_type."""
        return list(
            self.derived("layer_specs", lambda: family_of(self.model_type).layer_specs(self))
        )

    def derived(self, name: str, compute):
        """``compute()``, a pure function of the fields, computed once per field values: the
        memory plan asks the same counts of one shape for each of thousands of candidate
        layouts (trainer/plan/parallel_choice.py). A field set after the first call (the
        dataclass is not frozen) is seen, and everything is computed afresh; a value changed
        in place (rope_scaling's dict) is not, and none of these counts reads one."""
        fields = _field_values(self)
        memo = self.__dict__.get(_DERIVED)
        if memo is None or memo[0] != fields:
            memo = (fields, {})
            self.__dict__[_DERIVED] = memo
        if name not in memo[1]:
            memo[1][name] = compute()
        return memo[1][name]

    def is_sparse_layer(self, index: int) -> bool:
        """Layer ``index`` holds a mixture of experts."""
        return self.layer_specs()[index].sparse

    @property
    def kv_layers(self) -> int:
        """Layers whose token mixer keeps something per token, K/V or MLA's latent (the
        others keep a recurrent state)."""
        return self.derived("kv_layers", lambda: sum(not s.recurrent for s in self.layer_specs()))

    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        """K and V (or MLA's latent) of one token in every layer that keeps them per token
        (a sliding-window layer counted whole: cache_bytes_per_sequence bounds it)."""
        per_layer = self.cache_elements_per_token()
        return sum(per_layer[spec.cache] for spec in self.layer_specs()
                   if spec.cache != "recurrent") * element_bytes  # fmt: skip

    def cache_elements_per_token(self) -> dict[str, int]:
        """Elements one token keeps in one layer of each per-token cache kind: K and V of
        the kv heads; MLA's latent (kv_lora_rank + qk_rope_head_dim, shared by all heads)."""
        return {"kv": 2 * self.num_key_value_heads * self.head_dim,
                "latent": self.kv_lora_rank + self.qk_rope_head_dim}  # fmt: skip

    def cache_bytes_per_sequence(self, seq_len: int, element_bytes: int = 2) -> int:
        """What one sequence of seq_len tokens keeps in the per-token caches of every layer:
        a sliding-window layer a window's worth, the others every token."""
        per_layer = self.cache_elements_per_token()
        total = 0
        for spec in self.layer_specs():
            if spec.cache != "recurrent":
                tokens = min(seq_len, spec.window) if spec.window else seq_len
                total += per_layer[spec.cache] * tokens
        return total * element_bytes

    def recurrent_state_bytes(self, element_bytes: int = 2) -> int:
        """What one sequence keeps in the layers with a recurrent state, whatever its length:
        per Gated DeltaNet layer the conv's last kernel-1 inputs (``element_bytes`` each)
        and the [Hv, Dk, Dv] delta-rule state in fp32."""
        recurrent = self.num_hidden_layers - self.kv_layers
        if not recurrent:
            return 0
        conv, ssm = recurrent_state_elements(self)
        return recurrent * (conv * element_bytes + ssm * 4)

    def sparse_layer_indices(self) -> list[int]:
        """Layers with experts, in order: the L axis of routed_experts [.., L, k]."""
        return list(self.derived("sparse_layer_indices", lambda: [
            i for i, spec in enumerate(self.layer_specs()) if spec.sparse]))  # fmt: skip

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE turns."""
        return int(self.head_dim * self.partial_rotary_factor)

    def mlp_parameters(self, active: bool = False) -> int:
        """Weights of every layer's MLP: SwiGLU matrices of the dense layers, router and
        experts (and shared expert) of the sparse ones (active: the top-k experts one token
        runs through)."""
        return self.derived(("mlp_parameters", active), lambda: self._mlp_parameters(active))

    def _mlp_parameters(self, active: bool) -> int:
        h = self.hidden_size
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = self.num_experts * h + experts * 3 * h * self.moe_intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size + h  # + its sigmoid gate
        routed = experts * 3 * h * self.moe_intermediate_size
        grouped = self.num_experts * h + routed  # the router (its correction bias: a buffer)
        grouped += 3 * h * self.moe_intermediate_size * self.n_shared_experts
        biased = self.num_experts * (h + 1) + routed  # the router and its bias
        biased += experts * (2 * self.moe_intermediate_size + h)  # the experts' biases
        sizes = {"dense": 3 * h * self.intermediate_size, "experts": moe,
                 "experts_shared": moe + shared, "grouped_experts_shared": grouped,
                 "biased_experts": biased}  # fmt: skip
        return sum(sizes[spec.mlp] for spec in self.layer_specs())

    def mixer_parameters(self, mixer: str) -> int:
        """Weights of one token mixer of kind ``mixer`` (layer_spec.MIXER_KINDS)."""
        h, hd = self.hidden_size, self.head_dim
        if mixer == "mla":
            from hybridflow.models.families.deepseek_v3 import mla_parameters

            return mla_parameters(self)
        if mixer == "gated_deltanet":
            keys = self.linear_num_key_heads * self.linear_key_head_dim
            values = self.linear_num_value_heads * self.linear_value_head_dim
            conv = 2 * keys + values
            heads = self.linear_num_value_heads
            # in_proj_qkv, in_proj_z, in_proj_b/a, conv1d, dt_bias/A_log, norm, out_proj
            return (h * conv + h * values + 2 * h * heads + conv * self.linear_conv_kernel_dim
                    + 2 * heads + self.linear_value_head_dim + values * h)  # fmt: skip
        gate = 2 if mixer == "gated_attention" else 1  # q_proj also yields the output gate
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        attn = gate * h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += gate * q + 2 * kv
        if self.o_proj_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * hd
        if mixer == "sink_attention":
            attn += self.num_attention_heads  # one sink logit a head
        return attn

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def num_parameters(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Parameter count from the shapes (matches sum(p.numel()) of CausalLM).

        active: count only the experts one token runs through (top-k of each sparse layer)."""
        h = self.hidden_size
        mixers = self.derived("mixers", lambda: sum(self.mixer_parameters(spec.mixer)
                                                    for spec in self.layer_specs()))  # fmt: skip
        total = mixers + self.num_hidden_layers * 2 * h + h  # + 2 norms a layer, final norm
        total += self.mlp_parameters(active)
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        if self.vision is not None:
            total += self.vision.num_parameters()
        return total

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelArchitecture:
        """Build from the content of a HF config.json (transformers 4.x and 5.x layouts); a
        multimodal checkpoint's config gives its language model's (families.text_config).
        ModelConfigError naming ``source`` (the file) for a value no model can have."""
        check_config_values(hf, source)
        hf = text_config(hf)
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
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            torch_dtype=hf.get("torch_dtype", hf.get("dtype")),
            **family_of(model_type).fields_from_hf(hf),
        )

    def to_hf(self) -> dict[str, Any]:
        """Content of a HF config.json that transformers (4.x and 5.x) loads as the same model."""
        family = family_of(self.model_type)
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
            rope_parameters.setdefault("rope_type", self.rope_type)
        hf: dict[str, Any] = {
            "architectures": [family.ARCHITECTURES[self.model_type]],
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
        hf.update(family.fields_to_hf(self))
        nest = getattr(family, "nest_config", None)
        return hf if nest is None else nest(self, hf)

    def replace(self, **changes: Any) -> ModelArchitecture:
        return dataclasses.replace(self, **changes)


@functools.cache
def _field_getter() -> operator.attrgetter:
    return operator.attrgetter(*(f.name for f in dataclasses.fields(ModelArchitecture)))


def _field_values(arch: ModelArchitecture) -> tuple:
    """Every field's value, what ModelArchitecture.derived keys its values by."""
    return _field_getter()(arch)


def recurrent_state_elements(config) -> tuple[int, int]:
    """(conv state, SSM state) elements one sequence keeps per Gated DeltaNet layer: the last
    kernel-1 inputs of the conv and the [Hv, Dk, Dv] delta-rule state (held in fp32)."""
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    conv_dim += config.linear_num_value_heads * config.linear_value_head_dim
    conv = conv_dim * (config.linear_conv_kernel_dim - 1)
    ssm = config.linear_num_value_heads * config.linear_key_head_dim
    return conv, ssm * config.linear_value_head_dim
