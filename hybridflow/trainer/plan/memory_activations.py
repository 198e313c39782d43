"""What autograd keeps per token in the actor update, and the log-prob head's working set:
the activation items of the memory plan (trainer/plan/memory_plan.py), pure arithmetic."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture

LOGPROB_CHUNK_TOKENS = 4096
"""Tokens per logits chunk of models/logprobs.logprobs_from_hidden."""


DELTA_CHUNK_TOKENS = 64
"""Tokens per chunk of the chunked gated delta rule (fla-core's kernel, the torch reference)."""


def deltanet_mixer_elements(a: ModelArchitecture) -> int:
    """Elements per token a Gated DeltaNet mixer keeps for the backward
    (models/mixers/gated_deltanet.py): the fused q/k/v projection, its conv output and the
    SiLU of that (3 × conv width, 2·key + value), the L2-normalised q and k (2·key), z, the
    delta rule's output and the gated norm's (3·value), and per value head the fp32 log decay
    (2 units), beta and one row of its chunk's [C, C] triangular solve. Nothing grows with
    the sequence: the chunk states are recomputed in the backward (fla-core)."""
    key = a.linear_num_key_heads * a.linear_key_head_dim
    value = a.linear_num_value_heads * a.linear_value_head_dim
    return (
        3 * (2 * key + value)
        + 2 * key
        + 3 * value
        + a.linear_num_value_heads * (3 + DELTA_CHUNK_TOKENS)
    )


def layer_activation_elements(a: ModelArchitecture, sparse: bool = False, tp: int = 1,
                              mixer: str = "attention") -> int:  # fmt: skip
    """Elements per token one decoder layer keeps for the backward (below); tensor
    parallelism divides the head- and MLP-wide tensors by ``tp``, not the residual stream.
    ``mixer``: the layer's token mixer (models/layer_spec.MIXER_KINDS): Gated DeltaNet keeps
    deltanet_mixer_elements instead of attention's tensors, gated attention its output gate
    too."""
    h, i = a.hidden_size, a.intermediate_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    if a.kv_lora_rank:  # MLA: each head expands its own k and v; the latent and q's rank too
        q = a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        kv = (q + a.num_attention_heads * a.v_head_dim) // 2 + a.kv_lora_rank
        kv += a.q_lora_rank or 0
    attention = 4 * h + (2 * q + 2 * kv + ((q + kv) if a.qk_norm else 0)) // tp
    if mixer == "gated_attention":
        attention += q // tp  # the output gate (q_proj's other half)
    elif mixer == "gated_deltanet":
        attention = 4 * h + deltanet_mixer_elements(a) // tp
    shared = 4 * a.moe_intermediate_size * a.n_shared_experts // tp  # DeepSeek's shared experts
    return attention + (expert_activation_elements(a) + shared if sparse else 4 * i // tp)


def expert_activation_elements(a: ModelArchitecture) -> int:
    """Elements per token a sparse MLP keeps (models/moe.moe_experts): per routed copy (k of
    them) its gathered input row (h), gate/up, SiLU(gate) and their product (4I), its output
    unsorted (h) and in fp32 for the weighting (2h in 16-bit units); the router's logits and
    fp32 probabilities (3E)."""
    k, inner = a.num_experts_per_tok, a.moe_intermediate_size
    return k * (4 * inner + 4 * a.hidden_size) + 3 * a.num_experts


def layers_activation_elements(a: ModelArchitecture, tp: int = 1) -> int:
    """Elements per token all decoder layers keep (dense and sparse layers, attention and
    Gated DeltaNet layers differ)."""
    return sum(layer_activation_elements(a, spec.sparse, tp, spec.mixer)
               for spec in a.layer_specs())  # fmt: skip


def largest_layer_activation_elements(a: ModelArchitecture, tp: int = 1) -> int:
    """Elements per token of the largest decoder layer (the one recomputed at a time under
    checkpointing, the peak of a no-grad forward)."""
    kinds = {(spec.sparse, spec.mixer) for spec in a.layer_specs()}
    return max(layer_activation_elements(a, sparse, tp, mixer) for sparse, mixer in kinds)


def activation_bytes_per_token(a: ModelArchitecture, gradient_checkpointing: bool,
                               element_bytes: int = 2, tp: int = 1) -> int:  # fmt: skip
    """Bytes autograd keeps per token for the backward, over all layers.

    One layer without checkpointing keeps 4h + 2q + 2kv + 4i elements: the inputs of both
    RMSNorms and their outputs (4h; the outputs feed the projections), attention's q, k, v
    and output (2q + 2kv), and the MLP's gate, silu(gate), up and their product (4i); Qwen3's
    q/k-norm adds its inputs (q + kv), Qwen3.5's gated attention its output gate (q). A
    Gated DeltaNet layer keeps its mixer's instead of attention's (deltanet_mixer_elements).
    A mixture of experts' sparse layer keeps its experts'
    instead (expert_activation_elements). With checkpointing a layer keeps only its input (h)
    and one layer at a time is recomputed in full in the backward. The head adds the final
    norm's input and output and the gathered response states (3h)."""
    h, head = a.hidden_size, 3 * a.hidden_size
    if gradient_checkpointing:  # the largest layer is the one recomputed at a time
        elements = a.num_hidden_layers * h + largest_layer_activation_elements(a, tp) + head
    else:
        elements = layers_activation_elements(a, tp) + head
    return elements * element_bytes


def logprob_head_bytes(a: ModelArchitecture, tokens: int, compute_bytes: int = 2,
                       tp: int = 1) -> int:  # fmt: skip
    """The chunked log-prob head's working set: one [chunk, V] block of logits, the fp32
    [V, H] lm_head gradient accumulator and its copy in the compute dtype; 1/tp of the
    vocabulary each under tensor parallelism (models/sharding/vocab_parallel.py)."""
    chunk, vocab = min(tokens, LOGPROB_CHUNK_TOKENS), a.vocab_size // tp
    return chunk * vocab * compute_bytes + vocab * a.hidden_size * (4 + compute_bytes)
