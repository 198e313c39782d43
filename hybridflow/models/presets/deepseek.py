"""DeepSeek-V3's architecture and the published models built on it (DeepSeek-V3, Moonlight,
Kimi K2)."""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture


def deepseek_v3(**fields) -> ModelArchitecture:
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


DEEPSEEK_V3: dict[str, ModelArchitecture] = {
    # DeepSeek-V3 (and R1, V3.1: the same shape): 671 B parameters, 37 B active a token.
    "deepseek-v3": deepseek_v3(),
    # moonshotai/Moonlight-16B-A3B/config.json: DeepSeek-V3's layers at 16 B (2.2 B active
    # + embeddings): 2,048 wide, 27 layers (the first dense, MLP 11,264), 16 heads, q in one
    # projection, 64 experts of 1,408 (6 a token, one group, scaled by 2.446) and 2 shared;
    # RoPE theta 50,000 unscaled over 8,192 positions; vocab 163,840.
    "moonlight-16b-a3b": deepseek_v3(
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
    "kimi-k2": deepseek_v3(
        vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
        rope_theta=50000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings":
                      4096, "beta_fast": 1, "beta_slow": 1, "mscale": 1.0,
                      "mscale_all_dim": 1.0},
        num_experts=384, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        first_k_dense_replace=1, bos_token_id=163584, eos_token_id=163585,
    ),
}  # fmt: skip
