"""The values of a Hugging Face config.json, checked before a model is built from them
(no torch): ``hybridflow config validate`` and every model load refuse the same bad value
with the same message."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hybridflow.errors import UserError

# model_type values our own decoder implements (models/families: the same list, checked by a
# test; this module stays torch-free); everything else goes to the HF fallback.
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral",
    "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "qwen3_next",
    "deepseek_v3", "kimi_k2", "deepseek_v2", "gpt_oss", "qwen2_5_vl",
)  # fmt: skip
# model_type values whose vision encoder our decoder runs (prompts with images: data.image_key)
VISION_MODEL_TYPES = ("qwen2_5_vl",)
# sizes of a vision encoder (config.json's vision_config), whole numbers >= 1
VISION_SIZE_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                    "patch_size", "temporal_patch_size", "spatial_merge_size", "window_size",
                    "out_hidden_size")  # fmt: skip


class ModelConfigError(UserError, ValueError):
    """config.json cannot be read, or holds a value no model can be built from; ``str()``
    says which file, which key and why."""


SIZE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "moe_intermediate_size", "decoder_sparse_step",
    # the same sizes under other families' names (GPT-2, GPT-NeoX, Falcon, OPT, T5, …)
    "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "n_ctx", "num_layers",
    "num_heads", "num_kv_heads", "ffn_dim", "d_model", "d_ff", "rotary_dim",
    # Gated DeltaNet layers (Qwen3.5, Qwen3-Next)
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "shared_expert_intermediate_size",
    # multi-head latent attention and its routing (DeepSeek-V2/V3, Kimi-K2)
    "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "n_group", "topk_group",
)  # fmt: skip
"""Sizes: a whole number >= 1 where present (null: the family's default)."""

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Experts of a sparse layer, by family (0: a dense model)."""

TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
"""Experts each token is routed to (top-k), by family."""

COUNT_KEYS = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")
"""Counts that may be 0 (DeepSeek's always-on experts, its leading dense layers, its
multi-token-prediction layers): a whole number >= 0 where present."""

EPSILON_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
"""Added to a variance before its square root: a finite number > 0."""

REQUIRED_KEYS = {
    "dense": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads"),
    "qwen3_moe": ("moe_intermediate_size", "num_experts_per_tok"),
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "qwen3_5_moe_text": ("moe_intermediate_size", "num_experts", "num_experts_per_tok"),
    "qwen3_5_moe": ("moe_intermediate_size", "num_experts", "num_experts_per_tok"),
    "qwen3_next": ("moe_intermediate_size", "num_experts", "num_experts_per_tok"),
}  # fmt: skip
ROUTED_TYPES = ("qwen3_moe", "mixtral", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next", "gpt_oss")
"""Families whose sparse layers always route to experts: an expert count of 0 builds none."""
EXPERTS_ONLY_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
"""Families whose every layer routes to experts: no dense MLP width to require."""
"""Keys hybridflow's decoder reads without a default (its families: models/architecture.py)."""

MAX_SIZE = 2**31 - 1
"""Past int32: no model has a dimension that large, and index arithmetic overflows."""

LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "depth")
MAX_LAYERS = 4096
"""The deepest published decoders have under 200 layers; checks and the memory plan build a
list with one entry per layer, so a count past this would take memory before any refusal."""

FIX = "correct the value in config.json, or copy the model directory again"


def config_value_problems(config: dict[str, Any]) -> list[str]:
    """Every value of ``config`` (a parsed config.json) no model can be built from, one
    line each naming the key: sizes that are not whole numbers >= 1, a top-k outside
    1..experts, attention heads not a multiple of the KV heads, an epsilon or RoPE base that
    is not a finite number > 0. The families hybridflow's decoder builds
    (SUPPORTED_MODEL_TYPES) also need their sizes present and an even head dimension."""
    quantization = config.get("quantization_config")  # top level, also beside a text_config
    problems = []
    if quantization is not None and not isinstance(quantization, dict):
        problems.append(f"quantization_config = {_shown(quantization)} must be an object (e.g. "
                        '{"quant_method": "mxfp4"}) or absent (plain weights)')  # fmt: skip
    return problems + _value_problems(config)


def _value_problems(config: dict[str, Any]) -> list[str]:
    """:func:`config_value_problems` but for the top-level sections (text_config's values and
    the published Qwen2.5-VL's flat ones are read through it too)."""
    vision = config.get("vision_config")
    vision_problems = []
    if isinstance(vision, dict):
        vision_problems = [f"vision_config.{problem}" for key in VISION_SIZE_KEYS
                           if (problem := _whole_number_problem(key, vision.get(key), 1))]  # fmt: skip
        vision_problems = vision_problems or _vision_language_problems(config, vision)
    text = config.get("text_config")
    if isinstance(text, dict) and text.get("model_type") is None:
        # read as the outer family's language model (its keys required), as the loader does
        text = {**text, "model_type": config.get("model_type")}
    if isinstance(text, dict):  # a multimodal model: its language model is what we build
        return [f"text_config.{problem}" for problem in _value_problems(text)] + vision_problems
    if vision_problems:  # the published Qwen2.5-VL form: the language model's keys on top
        return vision_problems + _value_problems(
            {key: value for key, value in config.items() if key != "vision_config"}
        )
    problems: list[str] = []
    native = config.get("model_type") in SUPPORTED_MODEL_TYPES
    if native:
        required = REQUIRED_KEYS["dense"] + REQUIRED_KEYS.get(config["model_type"], ())
        if config["model_type"] in EXPERTS_ONLY_TYPES:
            required = tuple(key for key in required if key != "intermediate_size")
        problems += [f"{key} is missing (model_type {config['model_type']!r} needs it)"
                     for key in required if config.get(key) is None]  # fmt: skip
    sizes = {}
    # 0 experts is a dense model, whose top-k (if it names one) routes nothing
    minimums = {**dict.fromkeys(SIZE_KEYS, 1),
                **dict.fromkeys(EXPERT_COUNT_KEYS + TOP_K_KEYS + COUNT_KEYS, 0)}  # fmt: skip
    if config.get("model_type") in EXPERTS_ONLY_TYPES:
        minimums["intermediate_size"] = 0  # no dense MLP: written as 0 when written at all
    if config.get("model_type") in ROUTED_TYPES:
        minimums.update(dict.fromkeys(EXPERT_COUNT_KEYS, 1))
    for key, minimum in minimums.items():
        problem = _whole_number_problem(key, config.get(key), minimum)
        if problem:
            problems.append(problem)
        elif config.get(key) is not None:
            sizes[key] = config[key]
    problems += _top_k_problems(sizes)
    if sizes.get("topk_group", 0) > sizes.get("n_group", sizes.get("topk_group", 0)):
        problems.append(f"topk_group = {sizes['topk_group']} must be at most n_group = "
                        f"{sizes['n_group']} (the expert groups a token may be routed to)")  # fmt: skip
    problems += _head_problems(sizes, native)
    problems += _layout_problems(config, sizes)
    for key in EPSILON_KEYS:
        problems += _positive_number_problems(key, config.get(key))
    problems += _rope_problems(config)
    problems += _partial_rotary_problems(config, sizes)
    problems += _kind_problems(config)
    coefficient = config.get("router_aux_loss_coef")
    if coefficient is not None and not (_is_number(coefficient) and math.isfinite(coefficient)
                                        and coefficient >= 0):  # fmt: skip
        problems.append(
            f"router_aux_loss_coef = {_shown(coefficient)} must be a finite number >= 0"
        )
    return problems


def check_config_values(config: dict[str, Any], source: str | Path) -> None:
    """ModelConfigError naming ``source`` (the config.json) and each bad value; see
    :func:`config_value_problems`."""
    problems = config_value_problems(config)
    if problems:
        raise ModelConfigError(config_values_message(problems, source))


def config_values_message(problems: list[str], source: str | Path) -> str:
    """The one paragraph both ``validate`` and a model load print for bad values."""
    return f"{source}: {'; '.join(problems)}: {FIX}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole_number_problem(key: str, value: Any, minimum: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{key} = {_shown(value)} must be a whole number >= {minimum} (a JSON integer)"
    if value < minimum:
        return f"{key} = {value} must be a whole number >= {minimum}"
    if value > MAX_SIZE:
        return f"{key} = {value} is larger than any model's ({MAX_SIZE})"
    if key in LAYER_COUNT_KEYS and value > MAX_LAYERS:
        return f"{key} = {value} is more layers than any model has (at most {MAX_LAYERS})"
    return None


def _shown(value: Any) -> str:
    """``value`` as config.json spells it (``"64"``, ``true``, ``64.0``), cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _top_k_problems(sizes: dict[str, int]) -> list[str]:
    experts_key = next((key for key in EXPERT_COUNT_KEYS if sizes.get(key)), None)
    if experts_key is None:
        return []  # a dense model: no routing
    experts = sizes[experts_key]
    return [
        f"{key} = {sizes[key]} must be between 1 and {experts_key} = {experts} (each token "
        f"is routed to that many of the experts)"
        for key in TOP_K_KEYS
        if key in sizes and not 1 <= sizes[key] <= experts
    ]


def _head_problems(sizes: dict[str, int], native: bool) -> list[str]:
    heads, kv_heads = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        return [f"num_attention_heads = {heads} must be a multiple of num_key_value_heads = "
                f"{kv_heads} (each KV head serves a group of query heads)"]  # fmt: skip
    head_dim = sizes.get("head_dim")
    if native and head_dim is None and heads and sizes.get("hidden_size"):
        head_dim = sizes["hidden_size"] // heads
        if head_dim < 1:
            return [f"hidden_size = {sizes['hidden_size']} is smaller than num_attention_heads "
                    f"= {heads} (no head_dim set): each head needs at least one dimension"]  # fmt: skip
    if native and head_dim is not None and head_dim % 2:
        return [f"head_dim = {head_dim} must be even (rotary embeddings turn pairs of "
                f"dimensions){'' if 'head_dim' in sizes else ' (hidden_size / num_attention_heads)'}"]  # fmt: skip
    rope_dim = sizes.get("qk_rope_head_dim")  # multi-head latent attention's rotary part
    if native and rope_dim is not None and rope_dim % 2:
        return [f"qk_rope_head_dim = {rope_dim} must be even (rotary embeddings turn pairs of "
                "dimensions)"]  # fmt: skip
    return []


WINDOWED_LAYER = "sliding_attention"
LAYER_KINDS = ("full_attention", WINDOWED_LAYER, "linear_attention")
"""The layer_types entries hybridflow's decoder builds (models/families)."""


def _layout_problems(config: dict[str, Any], sizes: dict[str, int]) -> list[str]:
    """Values that must agree with each other: one layer_types entry per layer, a window
    for windowed layers, Gated DeltaNet value heads in groups of the key heads, experts that
    split into the routing groups (n_group) with enough of them for the top-k."""
    problems = []
    layer_types, layers = config.get("layer_types"), sizes.get("num_hidden_layers")
    if layer_types is not None and not (
        isinstance(layer_types, list) and all(isinstance(kind, str) for kind in layer_types)
    ):
        problems.append(f"layer_types = {_shown(layer_types)} must be a list of layer kinds "
                        "(e.g. \"full_attention\"), one per layer")  # fmt: skip
    elif layer_types is not None and layers is not None and len(layer_types) != layers:
        problems.append(f"layer_types names {len(layer_types)} layers, num_hidden_layers = "
                        f"{layers}: give one entry per layer")  # fmt: skip
    elif config.get("model_type") in SUPPORTED_MODEL_TYPES and layer_types is not None:
        unknown = sorted(set(layer_types) - set(LAYER_KINDS))
        if unknown:
            problems.append(f"layer_types holds {', '.join(map(repr, unknown))}: each entry "
                            f"must be one of {', '.join(LAYER_KINDS)}")  # fmt: skip
    window = config.get("sliding_window")
    problem = _whole_number_problem("sliding_window", window, 0)
    if problem:
        problems.append(problem)
    elif window == 0 and isinstance(layer_types, list) and WINDOWED_LAYER in layer_types:
        problems.append(f"sliding_window = 0, but layer_types has {WINDOWED_LAYER} layers: "
                        "their window must be >= 1 token")  # fmt: skip
    elif (window is None and isinstance(layer_types, list) and WINDOWED_LAYER in layer_types
          and config.get("model_type") in SUPPORTED_MODEL_TYPES):  # fmt: skip
        # our decoder cannot run them, and transformers' fallback failed deep in its build
        problems.append(f"sliding_window is missing or null, but layer_types has "
                        f"{WINDOWED_LAYER} layers: give their window in tokens (gpt-oss: 128)")  # fmt: skip
    key_heads, value_heads = sizes.get("linear_num_key_heads"), sizes.get("linear_num_value_heads")
    if key_heads and value_heads and value_heads % key_heads:
        problems.append(f"linear_num_value_heads = {value_heads} must be a multiple of "
                        f"linear_num_key_heads = {key_heads} (each key head serves a group of "
                        "value heads)")  # fmt: skip
    experts, groups = sizes.get("n_routed_experts"), sizes.get("n_group")
    if experts and groups and experts % groups:
        problems.append(f"n_routed_experts = {experts} must split evenly into n_group = "
                        f"{groups} groups of experts")  # fmt: skip
    elif experts and groups and sizes.get("topk_group") and sizes.get("num_experts_per_tok"):
        reachable = sizes["topk_group"] * (experts // groups)
        if sizes["num_experts_per_tok"] > reachable:
            problems.append(f"num_experts_per_tok = {sizes['num_experts_per_tok']} exceeds the "
                            f"{reachable} experts of topk_group = {sizes['topk_group']} groups "
                            f"(of {experts // groups} experts each) a token is routed within")  # fmt: skip
    return problems + _positive_number_problems(
        "routed_scaling_factor", config.get("routed_scaling_factor")
    )


BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
             "use_cache")  # fmt: skip
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
NAME_KEYS = ("model_type", "hidden_act", "torch_dtype", "dtype")


def _kind_problems(config: dict[str, Any]) -> list[str]:
    """Values of the wrong JSON kind that transformers refuses as it reads the file (the
    tokenizer reads config.json too): switches that are not true/false, token ids that are
    not whole numbers (a list of them for eos_token_id), names that are not strings."""
    problems = [f"{key} = {_shown(config[key])} must be true or false"
                for key in BOOL_KEYS if key in config and not isinstance(config[key], bool)]  # fmt: skip
    problems += [f"{key} = {_shown(config[key])} must be a string"
                 for key in NAME_KEYS if config.get(key) is not None
                 and not isinstance(config[key], str)]  # fmt: skip
    for key in TOKEN_ID_KEYS:
        value = config.get(key)
        ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
        if value is not None and not all(_is_whole(id_) for id_ in ids):
            problems.append(f"{key} = {_shown(value)} must be a token id (a whole number), "
                            f"{'a list of them ' if key == 'eos_token_id' else ''}or null")  # fmt: skip
    for section in ("rope_scaling", "rope_parameters"):
        value = config.get(section)
        for part in (value, *value.values()) if isinstance(value, dict) else ():
            kind = part.get("rope_type", part.get("type")) if isinstance(part, dict) else None
            if kind is not None and not isinstance(kind, str):
                problems.append(f"{section} rope_type = {_shown(kind)} must be a string")
    return problems


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_number_problems(key: str, value: Any) -> list[str]:
    if value is None:
        return []
    if not _is_number(value):
        return [f"{key} = {_shown(value)} must be a finite number > 0 (a JSON number)"]
    if not (math.isfinite(value) and value > 0):
        return [f"{key} = {value} must be a finite number > 0"]
    return []


def _rope_problems(config: dict[str, Any]) -> list[str]:
    """rope_theta (top level, or in transformers 5's rope_parameters, per attention kind
    for some families) and a scaling factor: finite numbers > 0."""
    problems = _positive_number_problems("rope_theta", config.get("rope_theta"))
    problems += _positive_number_problems("swiglu_limit", config.get("swiglu_limit"))  # GPT-OSS
    for section in ("rope_scaling", "rope_parameters"):
        value = config.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            problems.append(f"{section} = {_shown(value)} must be an object or null")
            continue
        nested = {f"{section}.{k}": v for k, v in value.items() if isinstance(v, dict)}
        for prefix, part in {section: value, **nested}.items():
            problems += _rope_part_problems(prefix, part)
    return problems


ROPE_POSITIVE_KEYS = ("rope_theta", "factor", "attention_factor", "beta_fast", "beta_slow")
"""RoPE settings that are finite numbers > 0: YaRN takes the log of its betas' turns and
scales cos/sin by its attention factor."""
ROPE_FINITE_KEYS = ("mscale", "mscale_all_dim")
"""YaRN's attention-factor coefficients (DeepSeek-V3): finite numbers (a NaN one made every
logit NaN, found only as the first update's gradient was)."""


def _rope_part_problems(prefix: str, part: dict[str, Any]) -> list[str]:
    """The numbers of one RoPE settings object (``prefix``: where it is in config.json)."""
    problems = []
    for key in ROPE_POSITIVE_KEYS:
        problems += _positive_number_problems(f"{prefix}.{key}", part.get(key))
    for key in ROPE_FINITE_KEYS:
        value = part.get(key)
        if value is not None and not (_is_number(value) and math.isfinite(value)):
            problems.append(f"{prefix}.{key} = {_shown(value)} must be a finite number")
    key = "original_max_position_embeddings"  # YaRN and llama3 divide by it
    problem = _whole_number_problem(f"{prefix}.{key}", part.get(key), 1)
    return problems + ([problem] if problem else [])


VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id",
                     "vision_end_token_id")  # fmt: skip


def _vision_language_problems(config: dict[str, Any], vision: dict[str, Any]) -> list[str]:
    """What a vision-language config must agree on (Qwen2.5-VL, either layout): the encoder's
    heads splitting its width, the vision token ids inside the vocabulary, and mRoPE's three
    sections of a head's frequency pairs (head_dim / 2)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    problems = []
    width, heads = vision.get("hidden_size"), vision.get("num_heads")
    if isinstance(width, int) and isinstance(heads, int) and width % heads:
        problems.append(f"vision_config.hidden_size = {width} must be a multiple of "
                        f"vision_config.num_heads = {heads}")  # fmt: skip
    vocab, ids = text.get("vocab_size"), {}
    for key in VISION_TOKEN_KEYS:
        value = config.get(key, text.get(key))
        if value is None:
            continue
        top = vocab - 1 if isinstance(vocab, int) and vocab >= 1 else MAX_SIZE
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
            problems.append(f"{key} = {_shown(value)} must be a token id, a whole number from "
                            f"0 to {top} (vocab_size - 1)")  # fmt: skip
        elif value in ids.values():  # one id for two marks: the model cannot tell them apart
            other = next(name for name, id_ in ids.items() if id_ == value)
            problems.append(f"{key} = {value} is {other} too: each vision token needs an id "
                            "of its own")  # fmt: skip
        else:
            ids[key] = value
    rope = {}
    for section in ("rope_scaling", "rope_parameters"):
        if isinstance(text.get(section), dict):
            rope.update(text[section])
    sections = rope.get("mrope_section")
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    )
    whole = isinstance(sections, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sections
    )
    # the pairs RoPE turns: a head's, or its partial_rotary_factor share (Qwen3.5's quarter)
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    factor = factor if isinstance(factor, (int, float)) and 0 < factor <= 1 else 1.0
    pairs = int(head_dim * factor) // 2 if isinstance(head_dim, int) else None
    turned = "head_dim / 2" if factor == 1.0 else f"head_dim * {factor} / 2"
    if sections is not None and not (whole and len(sections) == 3 and sum(sections) == pairs):
        problems.append(f"mrope_section = {_shown(sections)} must be three whole numbers >= 1 "
                        f"summing to {turned} = {pairs} (the frequency pairs each position "
                        "row turns)")  # fmt: skip
    return problems


def _partial_rotary_problems(config: dict[str, Any], sizes: dict[str, int]) -> list[str]:
    """partial_rotary_factor (top level or in the RoPE settings): the share of each head's
    dimensions RoPE turns, a number in (0, 1] that leaves an even count of them."""
    found = [("partial_rotary_factor", config.get("partial_rotary_factor"))]
    for section in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(section), dict):
            found.append((f"{section}.partial_rotary_factor",
                          config[section].get("partial_rotary_factor")))  # fmt: skip
    heads, hidden = sizes.get("num_attention_heads"), sizes.get("hidden_size")
    head_dim = sizes.get("head_dim") or (hidden // heads if heads and hidden else None)
    problems = []
    for key, factor in found:
        if factor is None:
            continue
        if not (_is_number(factor) and math.isfinite(factor) and 0 < factor <= 1):
            problems.append(f"{key} = {_shown(factor)} must be a number in (0, 1] (the share "
                            "of each head's dimensions RoPE turns)")  # fmt: skip
        elif head_dim and int(head_dim * factor) % 2 + (int(head_dim * factor) < 2):
            problems.append(f"{key} = {factor} turns {int(head_dim * factor)} of head_dim = "
                            f"{head_dim} dimensions: RoPE turns an even number >= 2 of them")  # fmt: skip
    return problems


def directory_config_problems(model_dir: str | Path) -> list[str]:
    """The bad values of ``model_dir``'s config.json as one message ([] when they are fine,
    or when the file is missing or not JSON: the model checks say that)."""
    path = Path(model_dir).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return []
    problems = config_value_problems(config) if isinstance(config, dict) else []
    return [config_values_message(problems, path)] if problems else []
