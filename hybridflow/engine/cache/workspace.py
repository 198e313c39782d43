"""The engine's working memory outside its KV cache: what the automatic cache size
(engine/allocation.py, and the memory plan's rollout items, trainer/plan/memory_rollout.py)
keeps free for a decode step's sampling and a prefill chunk's activations. One function, so
the engine and the plan size the cache alike. Pure arithmetic on the model's config."""

from __future__ import annotations

SAMPLING_BYTES_PER_LOGIT = 22
"""Per row and vocabulary entry of a decode step (engine/row_sampling.py): the logits in the
model's dtype (2), their fp32 copy z (4), the sorted values (4) and the sort's int64 indices
(8) when a row filters by top-k or top-p, the softmax over them (4)."""

ROUTER_BYTES_PER_EXPERT = 8
"""Per prefill token and expert: the router's logits and their fp32 softmax."""

MOE_BLOCK_ROWS = 128
"""The most rows a grouped-expert block pads an expert's pairs to (kernels/experts/moe.block_rows)."""


def engine_workspace_bytes(config, max_batch_size: int, max_prefill_tokens: int,
                           element_bytes: int = 2, tp: int = 1) -> int:  # fmt: skip
    """Bytes a decode step of ``max_batch_size`` rows or a prefill chunk of
    ``max_prefill_tokens`` tokens allocates beyond the weights and the KV cache, whichever
    is larger, plus the decode rows' sampling (it runs after every step).

    ``config`` has the model's widths (a ModelArchitecture or the model's config): hidden
    ``h``, dense MLP ``I``, q/k/v widths, and for a mixture of experts ``E`` experts, ``k`` a
    token, ``I_e`` wide. A prefill chunk of ``T`` tokens holds the residual stream and its
    normed copies (8h), attention's q, k, v and output (2q + 2kv) and the larger MLP: a
    dense one's gate/up, SiLU and product (4I), or a sparse one's k pairs a token, each with
    its gathered row, gate/up, SiLU·up and output (3I_e + 2h), the pairs padded to blocks
    of :data:`MOE_BLOCK_ROWS` per expert, and the router's fp32 logits and softmax (8E).
    ``tp``: the rollout's tensor-parallel ranks split the head-, MLP- and vocabulary-wide
    tensors. MLA's attention runs expanded in a prefill: see :func:`attention_width`. A
    vision-language model's prefill may be all image tokens: see :func:`vision_prefill`."""
    h = config.hidden_size
    sampling = max_batch_size * sampling_bytes_per_row(config, tp)
    tokens = max_prefill_tokens
    attention = attention_width(config) // tp
    per_token = 8 * h + attention + 4 * config.intermediate_size // tp
    prefill = tokens * per_token * element_bytes
    experts = getattr(config, "num_experts", 0) or 0
    if experts:
        k, inner = config.num_experts_per_tok, config.moe_intermediate_size
        pairs = tokens * k + experts * MOE_BLOCK_ROWS
        sparse = (tokens * (8 * h + attention) + pairs * (3 * inner + 2 * h)) * element_bytes
        sparse += tokens * experts * ROUTER_BYTES_PER_EXPERT
        prefill = max(prefill, sparse)
    return sampling + vision_prefill(config, tokens, prefill, element_bytes)


def sampling_bytes_per_row(config, tp: int = 1) -> int:
    """The part of engine_workspace_bytes each decoded row adds: its logits and their
    sampling over the vocabulary (a tensor-parallel rank's share of it). A cache that holds
    fewer rows than max_batch_size (sizing.state_slots) gives these bytes back."""
    return config.vocab_size // tp * SAMPLING_BYTES_PER_LOGIT


def vision_prefill(config, tokens: int, prefill: int, element_bytes: int = 2) -> int:
    """A prefill chunk's bytes when every one of its ``tokens`` may be an image token
    (engine/images.py): first the vision encoder, a block at a time over the merge_unit
    patches of each token (its input, norm, q/k/v, q and k turned in fp32 (4e of 2-byte
    elements), the attention's output and projection, the SwiGLU MLP's gate, up and product:
    11e + 3i a patch), then the language model's ``prefill`` beside the features kept for the
    prompts' other samples (a token's out_hidden_size). ``prefill`` for a text-only model."""
    vision = getattr(config, "vision", None)
    if vision is None:
        return prefill
    features = tokens * vision.out_hidden_size * element_bytes
    patches = tokens * vision.merge_unit
    encoder = patches * (11 * vision.hidden_size + 3 * vision.intermediate_size) * element_bytes
    return max(encoder, prefill) + features


def attention_width(config) -> int:
    """Elements a prefill token's attention holds: q, k, v and the output of the heads, 2q +
    2kv; for MLA (kv_lora_rank set) the expanded form's q, k, v and output, each zero-padded
    to the wider of the q/k and v head widths (models/mixers/mla.attend_expanded), kv_b's
    per-head product and the latent with its rope key (the latent cache holds only the last:
    its bytes are the cache's, not this workspace's)."""
    heads = config.num_attention_heads
    rank = getattr(config, "kv_lora_rank", 0) or 0
    if rank:
        nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        width = max(nope + rope, v)
        return heads * (4 * width + nope + v) + rank + rope
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (2 * heads + 2 * config.num_key_value_heads) * head_dim
