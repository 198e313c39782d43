"""OpenAI's GPT-OSS models (gpt-oss-20b, gpt-oss-120b)."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture


def gpt_oss(layers: int, experts: int) -> ModelArchitecture:
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


GPT_OSS: dict[str, ModelArchitecture] = {
    # openai/gpt-oss-20b: 24 layers, 32 experts (20.9 B parameters, 3.6 B active)
    "gpt-oss-20b": gpt_oss(24, 32),
    # openai/gpt-oss-120b: 36 layers, 128 experts (116.8 B parameters, 5.1 B active)
    "gpt-oss-120b": gpt_oss(36, 128),
}  # fmt: skip
