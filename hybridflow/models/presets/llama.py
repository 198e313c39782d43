"""Meta's Llama 3 and 3.1 models."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture

# The Llama 3 tokenizer: <|begin_of_text|>, <|end_of_text|>; no pad token.
_LLAMA3_TOKEN_IDS = {"bos_token_id": 128000, "eos_token_id": 128001}


def _llama3_rope_scaling() -> dict:
    """Llama 3.1's RoPE scaling (config.json rope_scaling; models/rope.py), a fresh dict for
    each preset so that changing one preset's copy changes no other."""
    return {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


LLAMA3: dict[str, ModelArchitecture] = {
    "llama3-8b": ModelArchitecture(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        **_LLAMA3_TOKEN_IDS,
    ),
    # meta-llama/Llama-3.1-8B config.json (same mirror as the Qwen sizes, qwen.py): llama3 RoPE
    # scaling (models/rope.py; parity with transformers in tests/models/test_parity.py).
    "llama3.1-8b": ModelArchitecture(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_llama3_rope_scaling(),
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        **_LLAMA3_TOKEN_IDS,
    ),
    # meta-llama/Llama-3.1-70B config.json: 70.6 B parameters; its shape for the memory plan
    # of multi-GPU layouts (docs/parallelism.md).
    "llama3.1-70b": ModelArchitecture(
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_llama3_rope_scaling(),
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        **_LLAMA3_TOKEN_IDS,
    ),
}  # fmt: skip
