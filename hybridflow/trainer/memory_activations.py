"""What autograd keeps per token in the actor update, and the log-prob head's working set:
the activation items of the memory plan (trainer/memory_plan.py), pure arithmetic."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture

LOGPROB_CHUNK_TOKENS = 4096
"""Tokens per logits chunk of models/logprobs.logprobs_from_hidden."""


def layer_activation_elements(a: ModelArchitecture) -> int:
    """Elements per token one decoder layer keeps for the backward (below)."""
    h, i = a.hidden_size, a.intermediate_size
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    return 4 * h + 2 * q + 2 * kv + 4 * i + ((q + kv) if a.qk_norm else 0)


def activation_bytes_per_token(a: ModelArchitecture, gradient_checkpointing: bool,
                               element_bytes: int = 2) -> int:  # fmt: skip
    """Bytes autograd keeps per token for the backward, over all layers.

    One layer without checkpointing keeps 4h + 2q + 2kv + 4i elements: the inputs of both
    RMSNorms and their outputs (4h; the outputs feed the projections), attention's q, k, v
    and output (2q + 2kv), and the MLP's gate, silu(gate), up and their product (4i); Qwen3's
    q/k-norm adds its inputs (q + kv). With checkpointing a layer keeps only its input (h)
    and one layer at a time is recomputed in full in the backward. The head adds the final
    norm's input and output and the gathered response states (3h)."""
    h, layer, head = a.hidden_size, layer_activation_elements(a), 3 * a.hidden_size
    if gradient_checkpointing:
        elements = a.num_hidden_layers * h + layer + head
    else:
        elements = a.num_hidden_layers * layer + head
    return elements * element_bytes


def logprob_head_bytes(a: ModelArchitecture, tokens: int, compute_bytes: int = 2) -> int:
    """The chunked log-prob head's working set: one [chunk, V] block of logits, the fp32
    [V, H] lm_head gradient accumulator and its copy in the compute dtype."""
    chunk = min(tokens, LOGPROB_CHUNK_TOKENS)
    vocab_matrix = a.vocab_size * a.hidden_size
    return chunk * a.vocab_size * compute_bytes + vocab_matrix * (4 + compute_bytes)
