import pytest

from hybridflow.models import ModelArchitecture

# Abridged config.json of Llama-3.1-8B as written by transformers 4.x.
LLAMA31_V4 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

# The same model as transformers 5.x writes it (theta moved into rope_parameters).
LLAMA31_V5 = {k: v for k, v in LLAMA31_V4.items() if k not in ("rope_theta", "rope_scaling")}
LLAMA31_V5["rope_parameters"] = {**LLAMA31_V4["rope_scaling"], "rope_theta": 500000.0}


@pytest.mark.parametrize("hf", [LLAMA31_V4, LLAMA31_V5], ids=["transformers4", "transformers5"])
def test_from_hf_reads_both_layouts(hf):
    config = ModelArchitecture.from_hf(hf)
    assert config.rope_theta == 500000.0
    assert config.rope_type == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.head_dim == 128 and config.num_key_value_heads == 8
    assert config.eos_token_id == [128001, 128008, 128009]
    assert not config.attention_bias and not config.qk_norm


def test_qwen2_bias_is_implied_and_qwen3_head_dim_is_explicit():
    qwen2 = ModelArchitecture.from_hf(
        {
            "model_type": "qwen2",
            "vocab_size": 10,
            "hidden_size": 64,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 1e6,
            "use_sliding_window": False,
            "sliding_window": 4096,
        }
    )
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.head_dim == 16
    assert qwen2.sliding_window is None
    qwen3 = ModelArchitecture.from_hf({**qwen2.to_hf(), "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32


def test_unsupported_inputs_name_the_problem():
    with pytest.raises(ValueError, match="backend='hf'"):
        ModelArchitecture(model_type="gemma")
    with pytest.raises(ValueError, match="longrope"):
        ModelArchitecture(rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="multiple of"):
        ModelArchitecture(num_attention_heads=6, num_key_value_heads=4)


def test_what_the_shape_determines_is_computed_again_when_a_field_changes():
    """ModelArchitecture.derived keeps the layer specs and parameter counts the memory plan
    asks thousands of times; the dataclass is not frozen, so a field set afterwards gives
    the counts of the new shape, and a caller changing the list it got changes nothing."""
    from hybridflow.models.plan_shapes import shape_of
    from hybridflow.models.presets import PRESETS

    arch = PRESETS["qwen3-30b-a3b"].replace()
    specs, total, shape = arch.layer_specs(), arch.num_parameters(), shape_of(arch)
    specs.clear()
    assert len(arch.layer_specs()) == arch.num_hidden_layers == 48
    arch.num_hidden_layers = 4
    assert len(arch.layer_specs()) == 4 and arch.kv_layers == 4
    assert arch.num_parameters() < total and shape_of(arch).layers == 4
    assert (
        arch.num_parameters()
        == PRESETS["qwen3-30b-a3b"].replace(num_hidden_layers=4).num_parameters()
    )
    arch.num_hidden_layers = 48
    assert arch.num_parameters() == total and shape_of(arch) == shape
