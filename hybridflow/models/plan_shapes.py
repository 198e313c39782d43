"""What the parallel memory plan needs to know of a model: parameters split into the parts
each layout divides differently, the widths it splits, and the KV cache's bytes per token.

A runtime model's shape comes from its ModelArchitecture (:func:`shape_of`). A model the
runtime cannot build yet can still be planned from its published shape: those are in
:data:`PLAN_ONLY_SHAPES`, usable by ``hybridflow config plan`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.models.architecture import ModelArchitecture


@dataclass(frozen=True)
class PlanShape:
    """Parameter counts and widths of one decoder model, as the parallel plan divides them."""

    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    attention_params: int
    """One layer's attention projections and norms (split by tensor parallelism)."""
    dense_mlp_params: int
    """One dense layer's MLP (0 for a model without dense layers)."""
    dense_layers: int
    sparse_layers: int
    expert_params: int
    """One routed expert's weights (split by tp, spread by ep)."""
    experts: int
    experts_per_token: int
    shared_params: int
    """One sparse layer's router and shared experts (replicated across ep)."""
    embedding_params: int
    """Input embedding plus lm_head (one matrix when tied), split by the vocabulary."""
    q_width: int
    """Elements per token of q (and of attention's output)."""
    kv_width: int
    """Elements per token of k (and of v)."""
    intermediate: int
    moe_intermediate: int
    kv_cache_elements: int
    """KV cache elements per token and layer, before tensor parallelism splits them."""
    kv_cache_splits: bool = True
    """The KV cache divides over the rollout's tensor-parallel ranks (GQA heads); False:
    every rank holds the whole latent (MLA)."""
    plan_only: str = ""
    """Why the runtime cannot build this model (empty: it can)."""
    kv_layers: int | None = None
    """Layers that keep K/V (None: every layer); the others keep a recurrent state."""
    state_bytes: int = 0
    """A sequence's recurrent state over all recurrent layers (conv + fp32 SSM), at the
    rollout's 2-byte elements; 0 for models without one."""
    window_layers: int = 0
    window: int = 0
    """Layers that attend over a sliding window of ``window`` tokens (GPT-OSS): their cache
    holds a window's worth of each sequence."""
    rollout_whole: int = 0
    """Of the layers' non-expert parameters, those every rank of a tensor-parallel rollout
    holds whole (:func:`rollout_whole_parameters`)."""

    @property
    def total_params(self) -> int:
        sparse = self.sparse_layers * (self.experts * self.expert_params + self.shared_params)
        return (
            self.layers * self.attention_params
            + self.dense_layers * self.dense_mlp_params
            + sparse
            + self.embedding_params
            + self.hidden
        )  # fmt: skip (+ final norm)

    @property
    def routed_params(self) -> int:
        """Every routed expert of every sparse layer."""
        return self.sparse_layers * self.experts * self.expert_params

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


def shape_of(a: ModelArchitecture) -> PlanShape:
    """The plan's view of a runtime model (its counts add up to ``a.num_parameters()``, plus
    DeepSeek's score-correction buffers, which the plan prices as the router's); computed
    once per shape (ModelArchitecture.derived)."""
    return a.derived("plan_shape", lambda: _shape_of(a))


def _shape_of(a: ModelArchitecture) -> PlanShape:
    h = a.hidden_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    kv_cache, splits = 2 * kv, True
    if any(spec.mixer == "mla" for spec in a.layer_specs()):  # every head expands the latent
        q = a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        kv = (q + a.num_attention_heads * a.v_head_dim) // 2  # k and v widths' mean
        kv_cache, splits = a.kv_lora_rank + a.qk_rope_head_dim, False
    attention = a.num_parameters(include_embeddings=False) - a.mlp_parameters() - h
    attention //= a.num_hidden_layers
    specs = a.layer_specs()
    sparse = [spec for spec in specs if spec.sparse]
    expert = 3 * h * a.moe_intermediate_size if a.is_moe else 0
    if any(spec.mlp == "biased_experts" for spec in sparse):
        expert += 2 * a.moe_intermediate_size + h  # each expert's biases
    dense = 3 * h * a.intermediate_size
    shared = a.num_experts * h  # the router
    if sparse:  # the rest of a sparse layer's MLP: router, its biases, shared experts
        sparse_mlp = a.mlp_parameters() - (len(specs) - len(sparse)) * dense
        shared = sparse_mlp // len(sparse) - a.num_experts * expert
    if a.topk_method == "noaux_tc" and any(s.mlp == "grouped_experts_shared" for s in sparse):
        shared += a.num_experts  # DeepSeek-V3's score-correction buffer
    windowed = [spec.window for spec in specs if spec.window]
    return PlanShape(
        layers=a.num_hidden_layers,
        hidden=h,
        vocab=a.vocab_size,
        heads=a.num_attention_heads,
        kv_heads=a.num_key_value_heads,
        attention_params=attention,
        dense_mlp_params=dense,
        dense_layers=a.num_hidden_layers - len(sparse),
        sparse_layers=len(sparse),
        expert_params=expert,
        experts=a.num_experts,
        experts_per_token=a.num_experts_per_tok,
        shared_params=shared,
        embedding_params=a.vocab_size * h * (1 if a.tie_word_embeddings else 2),
        q_width=q,
        kv_width=kv,
        intermediate=a.intermediate_size,
        moe_intermediate=a.moe_intermediate_size,
        kv_cache_elements=kv_cache,
        kv_cache_splits=splits,
        kv_layers=a.kv_layers,
        state_bytes=a.recurrent_state_bytes(2),
        window_layers=len(windowed),
        window=max(windowed, default=0),
        rollout_whole=rollout_whole_parameters(a),
    )


def rollout_whole_parameters(a: ModelArchitecture) -> int:
    """The layers' parameters every rank of a tensor-parallel rollout holds whole
    (parallel/blocks.rollout_shard_dim: no split dimension): the norms (Gated DeltaNet's gated
    norm too), o_proj's bias, MLA's q down-projection and latent projection with their norms
    (every head reads the one latent), a sparse layer's router with its bias or DeepSeek-V3's
    score correction (a buffer, priced with the router), Qwen3.5-MoE's shared-expert gate.
    The final norm is not counted (nor is it in the layers' parameters)."""
    h, bias = a.hidden_size, int(a.attention_bias)
    whole = 0
    for spec in a.layer_specs():
        whole += 2 * h + h * a.o_proj_bias  # the layer's two norms, o_proj's bias
        if spec.mixer == "mla":
            latent = a.kv_lora_rank + a.qk_rope_head_dim
            whole += (h + bias) * latent + a.kv_lora_rank
            if a.q_lora_rank is not None:
                whole += (h + bias + 1) * a.q_lora_rank
        elif spec.mixer == "gated_deltanet":  # its gated norm (one weight a head dimension)
            whole += a.linear_value_head_dim
        elif a.qk_norm:
            whole += 2 * a.head_dim
        if spec.sparse:
            corrected = spec.mlp == "grouped_experts_shared" and a.topk_method == "noaux_tc"
            extra = spec.mlp == "biased_experts" or corrected
            whole += a.num_experts * (h + extra)
            whole += h if spec.mlp == "experts_shared" else 0  # its shared expert's gate
    return whole


PLAN_ONLY_SHAPES: dict[str, PlanShape] = {}
"""Published shapes the runtime cannot build: ``config plan model.path=<name>`` plans them
(none today: DeepSeek-V3, once one, is a preset of the runtime)."""
