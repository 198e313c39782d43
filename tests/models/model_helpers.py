"""Small model configs and randomized models shared by the model tests (a module of its own,
not conftest: `from conftest import` picks whichever directory's conftest was imported first
when one pytest run collects several directories)."""

import torch

from hybridflow.models import ModelArchitecture, build_model


def small_config(model_type: str, **changes) -> ModelArchitecture:
    """A few-thousand-parameter config of each family, GQA by default."""
    fields = dict(
        model_type=model_type,
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    fields.update(changes)
    return ModelArchitecture(**fields)


def randomized_model(config: ModelArchitecture, seed: int = 0):
    """Our model with random weights, norms and biases too (so a wrongly placed norm shows)."""
    model = build_model(config, seed=seed)
    model.init_weights(seed=seed, std=0.15)  # logits of order 1, so errors are not hidden
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


def small_moe_config(model_type: str = "qwen3_moe", **changes) -> ModelArchitecture:
    """A few-thousand-parameter mixture of experts: 3 layers, 6 experts, top-2."""
    fields = dict(
        num_hidden_layers=3,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
    )
    if model_type == "qwen3_moe":
        fields.update(mlp_only_layers=(1,), norm_topk_prob=False)
    fields.update(changes)
    return small_config(model_type, **fields)
