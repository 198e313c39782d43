"""Named model shapes (random init) for tests and benchmarks; no weights are downloaded.

Shapes copied from the public config.json of each model."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture

# Built-in character tokenizer (tokenizer.py) ids; the tiny presets share its vocabulary.
_CHAR_PAD, _CHAR_EOS = 0, 4

# The Qwen2.5/Qwen3 tokenizer: <|endoftext|> as bos and pad, the Instruct models' <|im_end|>
# as eos (every Qwen preset).
_QWEN_TOKEN_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
# The Llama 3 tokenizer: <|begin_of_text|>, <|end_of_text|>; no pad token.
_LLAMA3_TOKEN_IDS = {"bos_token_id": 128000, "eos_token_id": 128001}


# Qwen3.5's config.json (text_config of Qwen/Qwen3.5-*/config.json): <|endoftext|> as bos
# and eos, as the published configs name them.
_QWEN3_5_TOKEN_IDS = {"bos_token_id": 248044, "eos_token_id": 248044}


def _qwen3_5(layers: int, **fields) -> ModelArchitecture:
    """A Qwen3.5 text model: what every published size shares (text_config of
    Qwen/Qwen3.5-{0.8B,4B,9B,35B-A3B}/config.json, as transformers' Qwen3_5TextConfig and
    Qwen3_5MoeTextConfig defaults also give them): every 4th layer gated attention (256-wide
    heads, RoPE on a quarter of each, theta 1e7), the others Gated DeltaNet with 16 key heads
    of 128 and a 4-tap conv, vocab 248,320, 262,144 positions."""
    shared = dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        num_hidden_layers=layers,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=262144,
        qk_norm=True,
        zero_centered_norms=True,
        layer_types=tuple(
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        **_QWEN3_5_TOKEN_IDS,
    )
    return ModelArchitecture(**{**shared, **fields})


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


PRESETS: dict[str, ModelArchitecture] = {
    # ~0.1M parameters: fast CPU tests. vocab_size 128 covers the built-in char tokenizer.
    "tiny": ModelArchitecture(
        model_type="qwen2",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=True,
        bos_token_id=None,
        eos_token_id=_CHAR_EOS,
        pad_token_id=_CHAR_PAD,
    ),
    # ~0.8M parameters: still CPU-fast, enough capacity to learn small synthetic tasks.
    "tiny-4l": ModelArchitecture(
        model_type="qwen2",
        vocab_size=128,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=True,
        eos_token_id=_CHAR_EOS,
        pad_token_id=_CHAR_PAD,
    ),
    # ~1.3M parameters (~0.5M active): the mixture-of-experts family at CPU-test size.
    # Layer 0 keeps a dense MLP (mlp_only_layers) so the mixed stack is exercised too.
    "tiny-moe": ModelArchitecture(
        model_type="qwen3_moe",
        vocab_size=128,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_id=_CHAR_EOS,
        pad_token_id=_CHAR_PAD,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        mlp_only_layers=(0,),
        router_aux_loss_coef=0.001,
    ),
    # ~0.2M parameters: the hybrid family at CPU-test size: 3 Gated DeltaNet layers (2 key
    # heads, 4 value heads) and 1 gated-attention layer, like Qwen3.5's 3-to-1 pattern.
    "tiny-hybrid": ModelArchitecture(
        model_type="qwen3_5_text",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        qk_norm=True,
        zero_centered_norms=True,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        eos_token_id=_CHAR_EOS,
        pad_token_id=_CHAR_PAD,
    ),
    "qwen2.5-0.5b": ModelArchitecture(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        **_QWEN_TOKEN_IDS,
    ),
    "qwen2.5-1.5b": ModelArchitecture(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        **_QWEN_TOKEN_IDS,
    ),
    "qwen2.5-7b": ModelArchitecture(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        attention_bias=True,
        **_QWEN_TOKEN_IDS,
    ),
    # Shapes below (and rope_theta, rms_norm_eps, max_position_embeddings, tying) are the
    # published config.json of each base model (huggingface.co/<org>/<model>/blob/main/
    # config.json), as mirrored in github.com/citsjtu2020/LLM-Prof, sglang/Model_Config.md.
    # The Instruct checkpoints share the shapes; token ids follow the presets above (the
    # Instruct models' <|im_end|> as eos). Parameter counts: tests/models.
    "qwen2.5-3b": ModelArchitecture(  # Qwen/Qwen2.5-3B: 3.09 B parameters
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        **_QWEN_TOKEN_IDS,
    ),
    "qwen2.5-14b": ModelArchitecture(  # Qwen/Qwen2.5-14B: 14.7 B parameters
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=True,
        **_QWEN_TOKEN_IDS,
    ),
    "qwen2.5-32b": ModelArchitecture(  # Qwen/Qwen2.5-32B: 32.5 B parameters
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=True,
        **_QWEN_TOKEN_IDS,
    ),
    "qwen3-0.6b": ModelArchitecture(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm=True,
        **_QWEN_TOKEN_IDS,
    ),
    # Qwen3 (same source as the Qwen2.5 sizes above): q/k-norm, no attention bias, head_dim
    # given explicitly, untied from 8B on.
    "qwen3-8b": ModelArchitecture(  # Qwen/Qwen3-8B: 8.2 B parameters
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        **_QWEN_TOKEN_IDS,
    ),
    "qwen3-14b": ModelArchitecture(  # Qwen/Qwen3-14B: 14.8 B parameters
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        **_QWEN_TOKEN_IDS,
    ),
    # Qwen/Qwen3-30B-A3B config.json: 30.5 B parameters, 3.3 B active (8 of 128 experts per
    # token on each of the 48 layers, all sparse); the routing weights are renormalised.
    "qwen3-30b-a3b": ModelArchitecture(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        **_QWEN_TOKEN_IDS,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        router_aux_loss_coef=0.001,
    ),
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
    # meta-llama/Llama-3.1-8B config.json (same mirror as the Qwen sizes): llama3 RoPE
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
    # Qwen/Qwen3-235B-A22B config.json: 235 B parameters, 22 B active (8 of 128 experts per
    # token on each of the 94 layers); 4 KV heads.
    "qwen3-235b-a22b": ModelArchitecture(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        **_QWEN_TOKEN_IDS,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        router_aux_loss_coef=0.001,
    ),
    # Qwen/Qwen3.5-0.8B text_config: 24 layers of 1,024, MLP 3,584, 8 heads (2 KV), 16
    # DeltaNet value heads, tied embeddings.
    "qwen3.5-0.8b": _qwen3_5(24, hidden_size=1024, intermediate_size=3584,
                             num_attention_heads=8, num_key_value_heads=2,
                             linear_num_value_heads=16, tie_word_embeddings=True),
    # Qwen/Qwen3.5-4B text_config: 32 layers of 2,560, MLP 9,216, 16 heads (4 KV), 32
    # DeltaNet value heads, tied embeddings.
    "qwen3.5-4b": _qwen3_5(32, hidden_size=2560, intermediate_size=9216,
                           num_attention_heads=16, num_key_value_heads=4,
                           linear_num_value_heads=32, tie_word_embeddings=True),
    # Qwen/Qwen3.5-9B text_config (transformers' Qwen3_5TextConfig defaults): 32 layers of
    # 4,096, MLP 12,288, 16 heads (4 KV), 32 DeltaNet value heads, untied lm_head.
    "qwen3.5-9b": _qwen3_5(32, hidden_size=4096, intermediate_size=12288,
                           num_attention_heads=16, num_key_value_heads=4,
                           linear_num_value_heads=32, tie_word_embeddings=False),
    # Qwen/Qwen3.5-35B-A3B text_config (transformers' Qwen3_5MoeTextConfig defaults): 40
    # layers of 2,048, 16 heads (2 KV), 32 DeltaNet value heads; every layer 256 experts of
    # 512 (8 a token, renormalised) plus a shared expert of 512 behind its sigmoid gate.
    "qwen3.5-35b-a3b": _qwen3_5(40, model_type="qwen3_5_moe_text", hidden_size=2048,
                                intermediate_size=0, num_attention_heads=16,
                                num_key_value_heads=2, linear_num_value_heads=32,
                                tie_word_embeddings=False, num_experts=256,
                                num_experts_per_tok=8, moe_intermediate_size=512,
                                shared_expert_intermediate_size=512, norm_topk_prob=True,
                                router_aux_loss_coef=0.001),
}  # fmt: skip


def preset_config(name: str) -> ModelArchitecture:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name].replace()  # a copy the caller may modify
