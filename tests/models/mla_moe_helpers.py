"""Tiny DeepSeek-V3 and GPT-OSS checkpoints written by transformers, every weight random
(norms, sinks, biases and DeepSeek's score correction too, so a misplaced one shows)."""

import json
from pathlib import Path

import torch

DEEPSEEK = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 0.707},
    max_position_embeddings=32, num_nextn_predict_layers=0,
)  # fmt: skip

GPT_OSS = dict(
    vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)  # fmt: skip


def _randomise(model, seed: int):
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if name.endswith(("norm.weight", "sinks")) else 0.15
            offset = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(torch.randn(param.shape, generator=generator) * scale + offset)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.3)
    return model.float().eval()


def deepseek_transformers(seed: int = 0, **changes):
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**DEEPSEEK, **changes})
    return _randomise(transformers.DeepseekV3ForCausalLM(config), seed)


def gpt_oss_transformers(seed: int = 0, **changes):
    import transformers

    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**GPT_OSS, **changes})
    return _randomise(transformers.GptOssForCausalLM(config), seed)


def edit_config(directory: Path, **changes) -> None:
    """Change entries of the config.json in ``directory``."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))


def packed_logits(model, packed, positions, cu_seqlens):
    hidden = model.forward_packed(packed, positions, cu_seqlens, int(cu_seqlens.diff().max()))
    return model.lm_head(hidden)


def deepseek_v2_transformers(seed: int = 0, **changes):
    """DeepSeek-V2's layers (softmax routing, no correction) at the same tiny size."""
    import transformers

    torch.manual_seed(seed)
    fields = {key: value for key, value in DEEPSEEK.items() if key != "num_nextn_predict_layers"}
    config = transformers.DeepseekV2Config(**{**fields, **changes})
    return _randomise(transformers.DeepseekV2ForCausalLM(config), seed)
