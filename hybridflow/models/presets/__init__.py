"""Named model shapes (random init) for tests and benchmarks; no weights are downloaded.

Shapes copied from the public config.json of each model."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.models.vision.spec import VisionSpec

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


def _deepseek_v3(**fields) -> ModelArchitecture:
    """The DeepSeek-V3 architecture (deepseek-ai/DeepSeek-V3/config.json): MLA with a 512
    latent and 64 RoPE dimensions, heads of 128 + 64 (q, k) and 128 (v), q through a 1,536
    rank; 7,168 wide, 61 layers, the first 3 dense (MLP 18,432), then 256 routed experts of
    2,048 (8 a token, in the 4 best of 8 groups, weights renormalised and scaled by 2.5) and
    one shared expert; YaRN x40 over 4,096 positions; vocab 129,280."""
    shared = dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=163840,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings":
                      4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                      "mscale_all_dim": 1.0},
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_interleave=True, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048, n_shared_experts=1, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return ModelArchitecture(**{**shared, **fields})


def _gpt_oss(layers: int, experts: int) -> ModelArchitecture:
    """openai/gpt-oss-{20b,120b}/config.json: 2,880 wide, 64 heads of 64 (8 KV) with sinks,
    sliding (128 tokens) and full layers alternating, sliding first; every layer's experts
    of 2,880 (4 a token) behind a biased router, SwiGLU clamped at 7; YaRN x32 over 4,096
    positions (not truncated); vocab 201,088 (o200k_harmony: <|return|> 200002 ends a
    turn, <|endoftext|> 199999 pads)."""
    return ModelArchitecture(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                      "truncate": False},
        attention_bias=True, o_proj_bias=True, attention_window=128,
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(layers)),
        num_experts=experts, num_experts_per_tok=4, moe_intermediate_size=2880,
        norm_topk_prob=True, router_aux_loss_coef=0.9, swiglu_alpha=1.702, swiglu_limit=7.0,
        eos_token_id=200002, pad_token_id=199999,
    )  # fmt: skip


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
    # ~0.4M parameters: DeepSeek-V3's layers at CPU-test size: MLA with q through a rank
    # and fewer KV heads than heads in config (MLA ignores them), a dense first layer, then
    # 8 experts in 4 groups (2 groups a token) and a shared expert.
    "tiny-deepseek-v3": _deepseek_v3(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=2048, rope_scaling=None, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
        first_k_dense_replace=1, tie_word_embeddings=True, eos_token_id=_CHAR_EOS,
        bos_token_id=None, pad_token_id=_CHAR_PAD,
    ),
    # ~0.2M parameters: GPT-OSS's layers at CPU-test size: sinks, a sliding layer of 8
    # tokens then a full one, 4 biased experts (2 a token).
    "tiny-gpt-oss": _gpt_oss(2, 4).replace(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_window=8,
        max_position_embeddings=2048, rope_scaling=None, num_experts_per_tok=2,
        router_aux_loss_coef=0.001, tie_word_embeddings=True, eos_token_id=_CHAR_EOS,
        pad_token_id=_CHAR_PAD,
    ),
    # ~0.2M parameters: Qwen2.5-VL at CPU-test size: a 2-layer language model and a 2-block
    # encoder of 8-pixel patches (windows of 2x2 tokens, the second block full); the image
    # token ids past the char tokenizer's.
    "tiny-vl": ModelArchitecture(
        model_type="qwen2_5_vl", vocab_size=128, hidden_size=64, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True, attention_bias=True, eos_token_id=_CHAR_EOS,
        pad_token_id=_CHAR_PAD, mrope_section=(2, 3, 3),
        vision=VisionSpec(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                          patch_size=8, window_size=32, fullatt_block_indexes=(1,),
                          out_hidden_size=64, image_token_id=124, video_token_id=125,
                          vision_start_token_id=126, vision_end_token_id=127),
    ),  # fmt: skip
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
    # DeepSeek-V3 (and R1, V3.1: the same shape): 671 B parameters, 37 B active a token.
    "deepseek-v3": _deepseek_v3(),
    # moonshotai/Moonlight-16B-A3B/config.json: DeepSeek-V3's layers at 16 B (2.2 B active
    # + embeddings): 2,048 wide, 27 layers (the first dense, MLP 11,264), 16 heads, q in one
    # projection, 64 experts of 1,408 (6 a token, one group, scaled by 2.446) and 2 shared;
    # RoPE theta 50,000 unscaled over 8,192 positions; vocab 163,840.
    "moonlight-16b-a3b": _deepseek_v3(
        vocab_size=163840, hidden_size=2048, intermediate_size=11264, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, rms_norm_eps=1e-5,
        rope_theta=50000.0, rope_scaling=None, max_position_embeddings=8192, q_lora_rank=None,
        num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2,
        n_group=1, topk_group=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
        bos_token_id=163584, eos_token_id=163585,
    ),
    # moonshotai/Kimi-K2-Instruct/config.json: DeepSeek-V3's layers at 1.04 T (32 B active):
    # 64 heads, 384 experts (8 a token, one group, scaled by 2.827), the first layer dense;
    # YaRN x32 (beta_fast 1) over 4,096 positions, theta 50,000; vocab 163,840.
    "kimi-k2": _deepseek_v3(
        vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
        rope_theta=50000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings":
                      4096, "beta_fast": 1, "beta_slow": 1, "mscale": 1.0,
                      "mscale_all_dim": 1.0},
        num_experts=384, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        first_k_dense_replace=1, bos_token_id=163584, eos_token_id=163585,
    ),
    # openai/gpt-oss-20b: 24 layers, 32 experts (20.9 B parameters, 3.6 B active)
    "gpt-oss-20b": _gpt_oss(24, 32),
    # openai/gpt-oss-120b: 36 layers, 128 experts (116.8 B parameters, 5.1 B active)
    "gpt-oss-120b": _gpt_oss(36, 128),
}  # fmt: skip


def preset_config(name: str) -> ModelArchitecture:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name].replace()  # a copy the caller may modify
