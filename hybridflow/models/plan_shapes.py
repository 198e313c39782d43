"""What the parallel memory plan needs to know of a model: parameters split into the parts
each layout divides differently, the widths it splits, and the KV cache's bytes per token.

A runtime model's shape comes from its ModelArchitecture (:func:`shape_of`). A model the
runtime cannot build yet can still be planned from its published shape: those are in
:data:`PLAN_ONLY_SHAPES` (``deepseek-v3``), usable by ``hybridflow config plan`` only.
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
    """The plan's view of a runtime model (its counts add up to ``a.num_parameters()``)."""
    h = a.hidden_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    attention = a.num_parameters(include_embeddings=False) - a.mlp_parameters() - h
    attention //= a.num_hidden_layers
    sparse = len(a.sparse_layer_indices())
    return PlanShape(
        layers=a.num_hidden_layers,
        hidden=h,
        vocab=a.vocab_size,
        heads=a.num_attention_heads,
        kv_heads=a.num_key_value_heads,
        attention_params=attention,
        dense_mlp_params=3 * h * a.intermediate_size,
        dense_layers=a.num_hidden_layers - sparse,
        sparse_layers=sparse,
        expert_params=3 * h * a.moe_intermediate_size if a.is_moe else 0,
        experts=a.num_experts,
        experts_per_token=a.num_experts_per_tok,
        shared_params=a.num_experts * h,  # the router
        embedding_params=a.vocab_size * h * (1 if a.tie_word_embeddings else 2),
        q_width=q,
        kv_width=kv,
        intermediate=a.intermediate_size,
        moe_intermediate=a.moe_intermediate_size,
        kv_cache_elements=2 * kv,
        kv_layers=a.kv_layers,
        state_bytes=a.recurrent_state_bytes(2),
    )


def _deepseek_v3() -> PlanShape:
    """deepseek-ai/DeepSeek-V3 config.json (671 B parameters without the MTP layer): 61
    layers, the first 3 dense (MLP 18,432), 58 with 256 routed experts of 2,048 (8 a token)
    and one shared expert; multi-head latent attention (MLA): q through a 1,536 rank, k/v
    through a 512 latent plus a 64-wide RoPE key, 128 heads of 128 + 64 (q, k) and 128 (v)."""
    h, heads = 7168, 128
    q_a, q_b = h * 1536 + 1536, 1536 * heads * (128 + 64)
    kv_a, kv_b = h * (512 + 64) + 512, 512 * heads * (128 + 128)
    attention = q_a + q_b + kv_a + kv_b + heads * 128 * h + 2 * h  # + o_proj and 2 norms
    return PlanShape(
        layers=61,
        hidden=h,
        vocab=129280,
        heads=heads,
        kv_heads=heads,
        attention_params=attention,
        dense_mlp_params=3 * h * 18432,
        dense_layers=3,
        sparse_layers=58,
        expert_params=3 * h * 2048,
        experts=256,
        experts_per_token=8,
        shared_params=3 * h * 2048 + 256 * h + 256,  # shared expert, router, its bias
        embedding_params=2 * 129280 * h,
        q_width=heads * (128 + 64),
        kv_width=heads * (128 + 64 + 128) // 2,  # k is 192 wide a head, v 128: their mean
        intermediate=18432,
        moe_intermediate=2048,
        kv_cache_elements=512 + 64,  # the latent and the RoPE key, shared by all heads
        kv_cache_splits=False,
        plan_only="multi-head latent attention (MLA) and shared experts are not in the "
        "runtime: this shape is for hybridflow config plan only",
    )


PLAN_ONLY_SHAPES: dict[str, PlanShape] = {"deepseek-v3": _deepseek_v3()}
"""Published shapes the runtime cannot build: ``config plan model.path=<name>`` plans them."""
