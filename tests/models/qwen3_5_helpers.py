"""Tiny Qwen3.5 checkpoints written by transformers (dense and MoE: 4 layers, 3 Gated
DeltaNet + 1 gated attention), shared by the Qwen3.5 tests."""

import torch

TINY_TEXT = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def transformers_model(moe: bool, seed: int = 0, next_: bool = False):
    """A transformers Qwen3_5(Moe)ForCausalLM (``next_``: Qwen3NextForCausalLM, experts on
    every other layer) with every weight random (norms and the DeltaNet decay too, so a
    misplaced one shows), fp32, eval mode."""
    import transformers

    torch.manual_seed(seed)
    if next_:
        config = transformers.Qwen3NextConfig(
            **TINY_TEXT, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=2,
        )  # fmt: skip
        model = transformers.Qwen3NextForCausalLM(config)
    elif moe:
        config = transformers.Qwen3_5MoeTextConfig(
            **TINY_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        )  # fmt: skip
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        config = transformers.Qwen3_5TextConfig(**TINY_TEXT, intermediate_size=48)
        model = transformers.Qwen3_5ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = 0.3 if name.endswith(("norm.weight", "A_log", "dt_bias")) else 0.15
            param.copy_(noise * scale + (param if name.endswith("A_log") else 0))
    return model.float().eval()


def two_sequences(vocab: int = 96, lengths: tuple[int, int] = (13, 8), seed: int = 3):
    """Two token rows of different lengths: (ids [2, T] right-padded, mask [2, T], packed
    ids [N], positions [N], cu_seqlens [3])."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (2, width), generator=generator)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    ids = ids * mask
    packed = torch.cat([ids[row, :length] for row, length in enumerate(lengths)])
    positions = torch.cat([torch.arange(length) for length in lengths])
    cu_seqlens = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    return ids, mask, packed, positions, cu_seqlens
