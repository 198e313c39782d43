"""Qwen's models: Qwen2.5 (and Qwen2.5-VL), Qwen3 (dense and mixture-of-experts) and
Qwen3.5 (Gated DeltaNet hybrids)."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.models.vision.spec import VisionSpec

# The Qwen2.5/Qwen3 tokenizer: <|endoftext|> as bos and pad, the Instruct models' <|im_end|>
# as eos (every Qwen preset).
_QWEN_TOKEN_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}

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


QWEN: dict[str, ModelArchitecture] = {
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
    # Qwen/Qwen2.5-VL-7B-Instruct: Qwen2.5-7B's language model (128,000 positions) and a
    # 32-block encoder of 1,280 (16 heads, MLP 3,420, 14-pixel patches, 112-pixel windows,
    # full attention in blocks 7, 15, 23, 31); mRoPE sections 16/24/24. 8.29 B parameters.
    "qwen2.5-vl-7b": ModelArchitecture(
        model_type="qwen2_5_vl", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=128000,
        tie_word_embeddings=False, attention_bias=True, mrope_section=(16, 24, 24),
        vision=VisionSpec(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                          patch_size=14, window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
                          out_hidden_size=3584, tokens_per_second=2),
        **_QWEN_TOKEN_IDS,
    ),  # fmt: skip
    # Qwen/Qwen2.5-VL-72B-Instruct: Qwen2.5-72B's language model (80 layers of 8,192, MLP
    # 29,568, 64 heads, 8 KV) and the 7B's encoder with an MLP of 3,456 (as the 3B's and
    # 32B's), merged into 8,192-wide features. 73.4 B parameters.
    "qwen2.5-vl-72b": ModelArchitecture(
        model_type="qwen2_5_vl", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=128000,
        tie_word_embeddings=False, attention_bias=True, mrope_section=(16, 24, 24),
        vision=VisionSpec(depth=32, hidden_size=1280, intermediate_size=3456, num_heads=16,
                          patch_size=14, window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
                          out_hidden_size=8192, tokens_per_second=2),
        **_QWEN_TOKEN_IDS,
    ),  # fmt: skip
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
    # Qwen/Qwen3-4B: 4.0 B parameters, 36 layers of 2,560, MLP 9,728, 32 heads (8 KV), tied
    # embeddings; every layer keeps K/V (the dense peer of qwen3.5-4b in the plan).
    "qwen3-4b": ModelArchitecture(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
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
    # Qwen/Qwen3.5-27B text_config (also Qwen3.6-27B's): 64 layers of 5,120, MLP 17,408, 24
    # heads (4 KV), 48 DeltaNet value heads, untied lm_head.
    "qwen3.5-27b": _qwen3_5(64, hidden_size=5120, intermediate_size=17408,
                            num_attention_heads=24, num_key_value_heads=4,
                            linear_num_value_heads=48, tie_word_embeddings=False),
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
    # Qwen/Qwen3.5-397B-A17B text_config: 60 layers of 4,096, 32 heads (2 KV), 64 DeltaNet
    # value heads; every layer 512 experts of 1,024 (10 a token, renormalised) plus a shared
    # expert of 1,024 behind its sigmoid gate.
    "qwen3.5-397b-a17b": _qwen3_5(60, model_type="qwen3_5_moe_text", hidden_size=4096,
                                  intermediate_size=0, num_attention_heads=32,
                                  num_key_value_heads=2, linear_num_value_heads=64,
                                  tie_word_embeddings=False, num_experts=512,
                                  num_experts_per_tok=10, moe_intermediate_size=1024,
                                  shared_expert_intermediate_size=1024, norm_topk_prob=True,
                                  router_aux_loss_coef=0.001),
}  # fmt: skip
