"""CPU-test-sized models (vocabulary of the built-in character tokenizer): a few layers of
each family the decoder runs."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.models.presets.deepseek import deepseek_v3
from hybridflow.models.presets.gpt_oss import gpt_oss
from hybridflow.models.vision.spec import VisionSpec

# Built-in character tokenizer (tokenizer.py) ids; the tiny presets share its vocabulary.
_CHAR_PAD, _CHAR_EOS = 0, 4

TINY: dict[str, ModelArchitecture] = {
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
    "tiny-deepseek-v3": deepseek_v3(
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
    "tiny-gpt-oss": gpt_oss(2, 4).replace(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_window=8,
        max_position_embeddings=2048, rope_scaling=None, num_experts_per_tok=2,
        router_aux_loss_coef=0.001, tie_word_embeddings=True, eos_token_id=_CHAR_EOS,
        pad_token_id=_CHAR_PAD,
    ),
    # Qwen3.5 with its encoder at CPU-test size: tiny-hybrid's layers with 32-wide heads (a
    # quarter turned: 4 pairs, interleaved mRoPE sections 2/1/1) and a 2-block encoder of
    # 8-pixel patches over a 4 x 4 learned position table; tiny-vl's image token ids.
    "tiny-hybrid-vl": ModelArchitecture(
        model_type="qwen3_5_text", vocab_size=128, hidden_size=64, intermediate_size=192,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25,
        max_position_embeddings=2048, tie_word_embeddings=True, qk_norm=True,
        zero_centered_norms=True, layer_types=("linear_attention",) * 3 + ("full_attention",),
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, eos_token_id=_CHAR_EOS,
        pad_token_id=_CHAR_PAD, mrope_section=(2, 1, 1), mrope_interleaved=True,
        vision=VisionSpec(kind="qwen3_5", depth=2, hidden_size=32, intermediate_size=64,
                          num_heads=2, patch_size=8, out_hidden_size=64,
                          hidden_act="gelu_pytorch_tanh", num_position_embeddings=16,
                          image_token_id=124, video_token_id=125, vision_start_token_id=126,
                          vision_end_token_id=127),
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
}  # fmt: skip
