"""config.json values no model can have are named by key, whatever the family; the configs
hybridflow writes and those of the common families pass."""

from __future__ import annotations

import json
import math

import pytest

from hybridflow.model_config_values import (
    SUPPORTED_MODEL_TYPES,
    ModelConfigError,
    check_config_values,
    config_value_problems,
    directory_config_problems,
)
from hybridflow.models.presets import PRESETS

MOE = PRESETS["tiny-moe"].to_hf()  # qwen3_moe: 8 experts, top-2, 4 heads over 2 KV heads
MIXTRAL = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "rms_norm_eps": 1e-5, "rope_theta": 1e6}  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 64}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": None,
        "n_positions": 128, "vocab_size": 128, "layer_norm_epsilon": 1e-5}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_config_passes(name):
    assert config_value_problems(PRESETS[name].to_hf()) == []


@pytest.mark.parametrize("config", [MIXTRAL, GPT2], ids=["mixtral", "gpt2"])
def test_other_families_pass(config):
    assert config_value_problems(config) == []


BAD_VALUES = [
    # (config, changes, the key named, words of the rule)
    (MOE, {"num_experts_per_tok": 9}, "num_experts_per_tok = 9", "between 1 and num_experts = 8"),
    (MOE, {"num_experts_per_tok": 0}, "num_experts_per_tok = 0", "between 1 and"),
    (MOE, {"num_experts_per_tok": -2}, "num_experts_per_tok = -2", ">= 0"),
    (MIXTRAL, {"num_experts_per_tok": 5}, "num_experts_per_tok = 5", "num_local_experts = 4"),
    (MOE, {"num_experts": -1}, "num_experts = -1", ">= 1"),  # qwen3_moe always routes
    (MOE, {"moe_intermediate_size": 0}, "moe_intermediate_size = 0", ">= 1"),
    (MOE, {"hidden_size": -64}, "hidden_size = -64", ">= 1"),
    (MOE, {"vocab_size": 0}, "vocab_size = 0", ">= 1"),
    (MOE, {"num_hidden_layers": 0}, "num_hidden_layers = 0", ">= 1"),
    (MOE, {"intermediate_size": -1}, "intermediate_size = -1", ">= 1"),
    (MOE, {"head_dim": 0}, "head_dim = 0", ">= 1"),
    (MOE, {"max_position_embeddings": 0}, "max_position_embeddings = 0", ">= 1"),
    (MOE, {"num_attention_heads": 0}, "num_attention_heads = 0", ">= 1"),
    (MOE, {"num_key_value_heads": 0}, "num_key_value_heads = 0", ">= 1"),
    (MOE, {"vocab_size": 2**40}, "vocab_size = 1099511627776", "larger than any model"),
    # a list of one entry per layer is built from the count: refused before it is
    (MOE, {"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000", "more layers than any"),
    (GPT2, {"n_layer": 10**6}, "n_layer = 1000000", "more layers than any model has"),
    (GPT2, {"n_embd": -8}, "n_embd = -8", ">= 1"),
    (MOE, {"num_key_value_heads": 3}, "num_attention_heads = 4", "multiple of num_key_value_heads = 3"),
    (MIXTRAL, {"num_key_value_heads": 8}, "num_attention_heads = 4", "num_key_value_heads = 8"),
    (MOE, {"head_dim": 31}, "head_dim = 31", "even"),
    (MOE, {"rms_norm_eps": 0.0}, "rms_norm_eps = 0.0", "finite number > 0"),
    (MOE, {"rms_norm_eps": -1e-6}, "rms_norm_eps = -1e-06", "finite number > 0"),
    (MOE, {"rms_norm_eps": math.nan}, "rms_norm_eps = nan", "finite number > 0"),
    (GPT2, {"layer_norm_epsilon": math.inf}, "layer_norm_epsilon = inf", "finite number > 0"),
    (MOE, {"rope_theta": 0}, "rope_theta = 0", "finite number > 0"),
    (MOE, {"rope_parameters": {"rope_type": "default", "rope_theta": -math.inf}},
     "rope_parameters.rope_theta = -inf", "finite number > 0"),
    (MOE, {"rope_scaling": {"rope_type": "linear", "factor": math.nan}},
     "rope_scaling.factor = nan", "finite number > 0"),
    (MOE, {"rope_scaling": "linear"}, 'rope_scaling = "linear"', "an object or null"),
    # YaRN's numbers (DeepSeek-V3): a NaN mscale made every logit NaN, found at the first update
    (MOE, {"rope_parameters": {**YARN, "mscale": math.nan}}, "rope_parameters.mscale = NaN",
     "must be a finite number"),
    (MOE, {"rope_scaling": {**YARN, "mscale_all_dim": math.inf}},
     "rope_scaling.mscale_all_dim = Infinity", "must be a finite number"),
    (MOE, {"rope_parameters": {**YARN, "beta_fast": 0}}, "rope_parameters.beta_fast = 0",
     "finite number > 0"),
    (MOE, {"rope_parameters": {**YARN, "attention_factor": -1.0}},
     "rope_parameters.attention_factor = -1.0", "finite number > 0"),
    (MOE, {"rope_parameters": {**YARN, "original_max_position_embeddings": 0}},
     "rope_parameters.original_max_position_embeddings = 0", "whole number >= 1"),
    (MOE, {"hidden_size": "128"}, 'hidden_size = "128"', "whole number"),
    (MOE, {"num_hidden_layers": True}, "num_hidden_layers = true", "whole number"),
    (MOE, {"intermediate_size": 384.0}, "intermediate_size = 384.0", "whole number"),
    (MOE, {"num_experts": [8]}, "num_experts = [8]", "whole number"),
    (MOE, {"rms_norm_eps": "1e-6"}, 'rms_norm_eps = "1e-6"', "number"),
    (MOE, {"router_aux_loss_coef": math.nan}, "router_aux_loss_coef = NaN", ">= 0"),
    (MOE, {"hidden_size": None}, "hidden_size is missing", "qwen3_moe"),
    # kinds transformers refuses while it reads the file (the tokenizer reads it too)
    (MOE, {"tie_word_embeddings": "yes"}, 'tie_word_embeddings = "yes"', "true or false"),
    (MOE, {"attention_bias": 1}, "attention_bias = 1", "true or false"),
    (MOE, {"bos_token_id": True}, "bos_token_id = true", "token id"),
    (MOE, {"eos_token_id": [4, "x"]}, 'eos_token_id = [4, "x"]', "a list of them"),
    (MOE, {"pad_token_id": 1.5}, "pad_token_id = 1.5", "token id"),
    (MOE, {"model_type": ["qwen3_moe"]}, 'model_type = ["qwen3_moe"]', "a string"),
    (MOE, {"hidden_act": 5}, "hidden_act = 5", "a string"),
    (MOE, {"torch_dtype": 16}, "torch_dtype = 16", "a string"),
    (MOE, {"rope_scaling": {"rope_type": ["yarn"], "factor": 2.0}}, 'rope_scaling rope_type = ["yarn"]', "a string"),
    # transformers' reading said "'str' object has no attribute 'to_dict'", naming no key
    (MOE, {"quantization_config": "mxfp4"}, 'quantization_config = "mxfp4"', "must be an object"),
]  # fmt: skip


@pytest.mark.parametrize("config, changes, key, rule", BAD_VALUES,
                         ids=[f"{c['model_type']}-{json.dumps(ch)}" for c, ch, _, _ in BAD_VALUES])  # fmt: skip
def test_a_bad_value_is_named_with_its_key(config, changes, key, rule):
    (problem,) = config_value_problems({**config, **changes})
    assert problem.startswith(key) and rule in problem


def test_the_error_names_the_file_and_every_problem(tmp_path):
    bad = {**MOE, "hidden_size": -1, "rms_norm_eps": math.nan}
    with pytest.raises(ModelConfigError) as error:
        check_config_values(bad, tmp_path / "config.json")
    text = str(error.value)
    assert text.startswith(f"{tmp_path / 'config.json'}: hidden_size = -1")
    assert "rms_norm_eps = nan" in text and "correct the value in config.json" in text
    (tmp_path / "config.json").write_text(json.dumps(bad))  # NaN: Python's json reads it
    assert directory_config_problems(tmp_path) == [text]


def test_the_torch_free_list_of_our_families_is_the_families_own():
    from hybridflow.models.families import SUPPORTED_MODEL_TYPES as families_types

    assert sorted(SUPPORTED_MODEL_TYPES) == sorted(families_types)


def test_more_expert_groups_chosen_than_there_are_is_named():
    config = {**PRESETS["tiny-deepseek-v3"].to_hf(), "n_group": 2, "topk_group": 3}
    assert config_value_problems(config) == [
        "topk_group = 3 must be at most n_group = 2 (the expert groups a token may be routed to)"
    ]


VISION = {"depth": 2, "hidden_size": 32, "num_heads": 2, "patch_size": 14, "out_hidden_size": 64}


@pytest.mark.parametrize("nested", [True, False], ids=["text_config", "published-flat"])
def test_a_bad_vision_encoder_size_is_named_with_its_key(nested):
    text = {key: MOE[key] for key in ("vocab_size", "hidden_size", "intermediate_size",
                                      "num_hidden_layers", "num_attention_heads")}  # fmt: skip
    vision = {**VISION, "num_heads": 0}
    config = {"model_type": "qwen2_5_vl", "vision_config": vision}
    config.update({"text_config": text} if nested else text)
    assert config_value_problems(config) == [
        "vision_config.num_heads = 0 must be a whole number >= 1"
    ]
    assert config_value_problems({**config, "vision_config": VISION}) == []
    deep = {**config, "vision_config": {**VISION, "depth": 10**9}}
    assert config_value_problems(deep) == [
        "vision_config.depth = 1000000000 is more layers than any model has (at most 4096)"
    ]


DEEPSEEK = PRESETS["tiny-deepseek-v3"].to_hf()  # 8 routed experts in n_group = 4, top-2
GPT_OSS = PRESETS["tiny-gpt-oss"].to_hf()  # 2 layers: sliding, full; sliding_window 8
HYBRID = PRESETS["tiny-hybrid"].to_hf()  # Qwen3.5: 4 layers, 2 key heads, 4 value heads

MISMATCHED_VALUES = [
    # (config, changes, the key named, words of the rule)
    (GPT_OSS, {"layer_types": ["sliding_attention"]}, "layer_types names 1 layers",
     "num_hidden_layers = 2"),
    (HYBRID, {"layer_types": ["linear_attention"] * 5}, "layer_types names 5 layers",
     "num_hidden_layers = 4"),
    (HYBRID, {"layer_types": "linear_attention"}, 'layer_types = "linear_attention"', "a list"),
    (HYBRID, {"layer_types": ["linear_attention", "foo", "linear_attention", "full_attention"]},
     "layer_types holds 'foo'", "must be one of full_attention, sliding_attention"),
    (GPT_OSS, {"sliding_window": 0}, "sliding_window = 0", "window must be >= 1"),
    (GPT_OSS, {"sliding_window": -4}, "sliding_window = -4", ">= 0"),
    (GPT_OSS, {"sliding_window": None}, "sliding_window is missing or null",
     "give their window in tokens"),
    (HYBRID, {"linear_num_value_heads": 3}, "linear_num_value_heads = 3",
     "multiple of linear_num_key_heads = 2"),
    (DEEPSEEK, {"n_group": 3, "topk_group": 2}, "n_routed_experts = 8",
     "split evenly into n_group = 3"),
    (DEEPSEEK, {"num_experts_per_tok": 6, "topk_group": 2}, "num_experts_per_tok = 6",
     "exceeds the 4 experts of topk_group = 2"),
    (DEEPSEEK, {"routed_scaling_factor": math.nan}, "routed_scaling_factor = nan",
     "finite number > 0"),
    (DEEPSEEK, {"routed_scaling_factor": 0}, "routed_scaling_factor = 0", "finite number > 0"),
    (DEEPSEEK, {"qk_rope_head_dim": 7}, "qk_rope_head_dim = 7", "must be even"),
    (DEEPSEEK, {"n_shared_experts": -1}, "n_shared_experts = -1", "whole number >= 0"),
    (GPT_OSS, {"num_local_experts": 0}, "num_local_experts = 0", "whole number >= 1"),
    (MOE, {"num_experts": 0}, "num_experts = 0", "whole number >= 1"),
    (GPT_OSS, {"swiglu_limit": -1.0}, "swiglu_limit = -1.0", "finite number > 0"),
    (DEEPSEEK, {"first_k_dense_replace": -1}, "first_k_dense_replace = -1", ">= 0"),
    (HYBRID, {"rope_parameters": {**HYBRID["rope_parameters"], "partial_rotary_factor": 2.0}},
     "rope_parameters.partial_rotary_factor = 2.0", "a number in (0, 1]"),
    (HYBRID, {"partial_rotary_factor": 0}, "partial_rotary_factor = 0", "a number in (0, 1]"),
    (HYBRID, {"partial_rotary_factor": "half"}, 'partial_rotary_factor = "half"', "(0, 1]"),
    (HYBRID, {"partial_rotary_factor": 3 / HYBRID["head_dim"]}, "partial_rotary_factor = 0.",
     f"turns 3 of head_dim = {HYBRID['head_dim']} dimensions: RoPE turns an even number"),
]  # fmt: skip


@pytest.mark.parametrize("config, changes, key, rule", MISMATCHED_VALUES,
                         ids=[f"{c['model_type']}-{json.dumps(ch)}"
                              for c, ch, _, _ in MISMATCHED_VALUES])  # fmt: skip
def test_values_that_disagree_with_each_other_are_named(config, changes, key, rule):
    (problem,) = config_value_problems({**config, **changes})
    assert problem.startswith(key) and rule in problem


def test_a_window_larger_than_the_context_or_null_is_fine():
    assert config_value_problems({**GPT_OSS, "sliding_window": 10**6}) == []
    assert config_value_problems({**MIXTRAL, "sliding_window": None}) == []
    assert config_value_problems({**MIXTRAL, "sliding_window": 0}) == []  # no windowed layers


VL = PRESETS["tiny-vl"].to_hf()  # nested: text_config (16-dim heads), a 32-wide encoder


def _with_mrope(section):
    text = {**VL["text_config"], "rope_parameters": {**VL["text_config"]["rope_parameters"],
                                                     "mrope_section": section}}  # fmt: skip
    return {"text_config": text}


@pytest.mark.parametrize(
    "changes, words",
    [
        (_with_mrope([2, 3, 4]), "mrope_section = [2, 3, 4] must be three whole numbers >= 1 "
         "summing to head_dim / 2 = 8"),
        (_with_mrope([10, -1, -1]), "mrope_section = [10, -1, -1] must be three"),
        (_with_mrope([4, 4]), "mrope_section = [4, 4] must be three"),
        (_with_mrope("2,3,3"), 'mrope_section = "2,3,3" must be three'),
        ({"image_token_id": 10**6}, "image_token_id = 1000000 must be a token id, a whole "
         f"number from 0 to {VL['text_config']['vocab_size'] - 1}"),
        ({"vision_start_token_id": -1}, "vision_start_token_id = -1 must be a token id"),
        ({"video_token_id": VL["image_token_id"]}, f"video_token_id = {VL['image_token_id']} is "
         "image_token_id too: each vision token needs an id of its own"),
        ({"image_token_id": "<|image_pad|>"}, 'image_token_id = "<|image_pad|>" must be a token'),
        ({"vision_config": {**VL["vision_config"], "num_heads": 3}},
         "vision_config.hidden_size = 32 must be a multiple of vision_config.num_heads = 3"),
    ],
    ids=["mrope-sum", "mrope-negative", "mrope-two", "mrope-text", "image-token-past-vocab",
         "negative-token", "shared-token", "token-as-text", "encoder-heads"],
)  # fmt: skip
def test_what_a_vision_language_config_must_agree_on_is_named(changes, words):
    assert config_value_problems(VL) == []
    (problem,) = config_value_problems({**VL, **changes})
    assert problem.startswith(words)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe", "qwen2_5_vl"])
def test_a_text_config_without_its_sizes_is_named_as_the_family_reads_it(model_type):
    """An empty text_config was read as no family's: validate passed, and the load built the
    family's default-sized language model (billions of weights) from it."""
    problems = config_value_problems(
        {"model_type": model_type, "text_config": {}, "vision_config": VISION}
    )
    assert problems[0] == f"text_config.vocab_size is missing (model_type {model_type!r} needs it)"
    moe = model_type == "qwen3_5_moe"
    assert any("text_config.num_experts is missing" in p for p in problems) == moe
    assert any("text_config.intermediate_size" in p for p in problems) != moe


def test_a_quantization_config_beside_a_text_config_is_checked_too():
    config = {**VL, "quantization_config": ["fp8"]}
    assert config_value_problems(config) == [
        'quantization_config = ["fp8"] must be an object (e.g. {"quant_method": "mxfp4"}) or '
        "absent (plain weights)"
    ]


def test_a_published_qwen3_5_multimodal_config_has_no_problems():
    # 256-wide heads of which a quarter turns: the interleaved mRoPE sections cover 32 pairs,
    # not head_dim / 2 (counting a whole head refused every published Qwen3.5 config)
    rope = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}  # fmt: skip
    text = {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 2560,
            "intermediate_size": 9216, "num_hidden_layers": 32, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 256, "rope_parameters": rope}  # fmt: skip
    vision = {"model_type": "qwen3_5_vision", "depth": 24, "hidden_size": 1024,
              "intermediate_size": 4096, "num_heads": 16, "out_hidden_size": 2560,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "num_position_embeddings": 2304}  # fmt: skip
    config = {"model_type": "qwen3_5", "text_config": text, "vision_config": vision,
              "image_token_id": 248056, "video_token_id": 248057,
              "vision_start_token_id": 248053, "vision_end_token_id": 248054}  # fmt: skip
    assert config_value_problems(config) == []
    text["rope_parameters"] = {**rope, "mrope_section": [24, 20, 20]}  # a whole head's
    assert any("summing to head_dim * 0.25 / 2 = 32" in p for p in config_value_problems(config))
