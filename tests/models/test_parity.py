"""Logits equal transformers' on the same weights, for each family (fp32, CPU)."""

import pytest
import torch
import transformers
from model_helpers import randomized_model, small_config

TOLERANCE = 1e-4


def to_transformers(model):
    hf_config = transformers.AutoConfig.for_model(**model.config.to_hf())
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    missing, unexpected = hf_model.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}
    if model.config.tie_word_embeddings:
        hf_model.tie_weights()
        assert hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
    return hf_model.eval()


CASES = {
    "llama": small_config("llama"),
    "llama-tied-mha": small_config("llama", tie_word_embeddings=True, num_key_value_heads=4),
    "llama3-rope-scaling": small_config(
        "llama",
        rope_theta=500000.0,
        max_position_embeddings=512,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-linear-rope": small_config("llama", rope_scaling={"type": "linear", "factor": 2.0}),
    "qwen2-yarn-rope": small_config(
        "qwen2",
        head_dim=16,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "llama-bias": small_config("llama", attention_bias=True, o_proj_bias=True),
    "mistral": small_config("mistral", sliding_window=4096),
    "qwen2-bias-tied": small_config("qwen2", tie_word_embeddings=True),
    "qwen3-qk-norm": small_config("qwen3", head_dim=16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case):
    model = randomized_model(CASES[case])
    hf_model = to_transformers(model)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 128))
    with torch.no_grad():
        ours = model(input_ids)
        theirs = hf_model(input_ids).logits
    assert ours.shape == theirs.shape == (2, 128, model.config.vocab_size)
    assert (ours - theirs).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("case", ["qwen2-bias-tied", "llama3-rope-scaling"])
def test_padded_logits_match_transformers(case):
    """Left padding with positions from the mask, as in generation."""
    model = randomized_model(CASES[case])
    hf_model = to_transformers(model)
    input_ids = torch.randint(3, model.config.vocab_size, (3, 24))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    attention_mask[1, :11] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = model(input_ids, attention_mask)
        theirs = hf_model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).logits
    valid = attention_mask.bool()
    assert (ours[valid] - theirs[valid]).abs().max().item() <= TOLERANCE
