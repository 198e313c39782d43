"""What autograd keeps per token in the actor update, and the log-prob head's working set:
the activation items of the memory plan (trainer/plan/memory_plan.py), pure arithmetic."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture

LOGPROB_CHUNK_TOKENS = 4096
"""Tokens per logits chunk of models/logprobs.logprobs_from_hidden."""


def layer_activation_elements(a: ModelArchitecture, sparse: bool = False, tp: int = 1) -> int:
    """Elements per token one decoder layer keeps for the backward (below); tensor
    parallelism divides the head- and MLP-wide tensors by ``tp``, not the residual stream."""
    h, i = a.hidden_size, a.intermediate_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    if a.kv_lora_rank:  # MLA: each head expands its own k and v; the latent and q's rank too
        q = a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        kv = (q + a.num_attention_heads * a.v_head_dim) // 2 + a.kv_lora_rank
        kv += a.q_lora_rank or 0
    attention = 4 * h + (2 * q + 2 * kv + ((q + kv) if a.qk_norm else 0)) // tp
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
    """Elements per token all decoder layers keep (dense and sparse layers differ)."""
    sparse = len(a.sparse_layer_indices())
    dense = a.num_hidden_layers - sparse
    return (dense * layer_activation_elements(a, tp=tp)
            + sparse * layer_activation_elements(a, True, tp))  # fmt: skip


def activation_bytes_per_token(a: ModelArchitecture, gradient_checkpointing: bool,
                               element_bytes: int = 2, tp: int = 1) -> int:  # fmt: skip
    """Bytes autograd keeps per token for the backward, over all layers.

    One layer without checkpointing keeps 4h + 2q + 2kv + 4i elements: the inputs of both
    RMSNorms and their outputs (4h; the outputs feed the projections), attention's q, k, v
    and output (2q + 2kv), and the MLP's gate, silu(gate), up and their product (4i); Qwen3's
    q/k-norm adds its inputs (q + kv). A mixture of experts' sparse layer keeps its experts'
    instead (expert_activation_elements). With checkpointing a layer keeps only its input (h)
    and one layer at a time is recomputed in full in the backward. The head adds the final
    norm's input and output and the gathered response states (3h)."""
    h, head = a.hidden_size, 3 * a.hidden_size
    if gradient_checkpointing:  # the largest layer is the one recomputed at a time
        layer = max(layer_activation_elements(a, a.is_moe, tp), layer_activation_elements(a, tp=tp))
        elements = a.num_hidden_layers * h + layer + head
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
