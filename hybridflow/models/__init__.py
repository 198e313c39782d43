"""Model runtime: one decoder, built layer by layer from layer specs (models/layer_spec.py:
attention or Gated DeltaNet token mixers, dense or expert MLPs), that reads and writes Hugging
Face checkpoints of the families in models/families/.

model = load_model("qwen2.5-0.5b", dtype=torch.bfloat16, device="cuda")  # preset, random
model = load_model("/path/to/hf_dir")                                    # HF checkpoint
tokenizer = load_tokenizer("/path/to/hf_dir")  # or "char" for the built-in one
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from hybridflow.config import ConfigError
from hybridflow.model_config_values import (
    VISION_MODEL_TYPES,
    ModelConfigError,
    config_values_message,
)
from hybridflow.models.architecture import SUPPORTED_MODEL_TYPES, ModelArchitecture
from hybridflow.models.presets import PRESETS, preset_config

if TYPE_CHECKING:
    import torch

    from hybridflow.models.llama import CausalLM

__all__ = [
    "PRESETS",
    "CausalLM",
    "ModelArchitecture",
    "build_model",
    "load_model",
    "load_tokenizer",
]

PRESET_SEED = 0


def __getattr__(name: str):
    """``CausalLM`` on first use: torch loads with it, and the shape-only modules below this
    package (architecture, presets, plan_shapes) are read by `hybridflow config` commands
    that never build a model."""
    if name == "CausalLM":
        from hybridflow.models.llama import CausalLM

        return CausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(
    config: ModelArchitecture,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = PRESET_SEED,
    num_labels: int | None = None,
) -> CausalLM:
    """Randomly initialised model (built on meta, materialised once on `device`), in
    ``dtype`` (None: float32); ``num_labels``: a sequence classifier (a reward model's score
    head) instead of a LM."""
    import torch

    from hybridflow.models.llama import CausalLM

    dtype = torch.float32 if dtype is None else dtype
    with torch.device("meta"):
        model = CausalLM(config, num_labels=num_labels)
    # the dtype first, on meta: materialising in fp32 would need twice the memory (a 30B
    # model's 122 GB before the cast to bf16)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()  # to_empty keeps sharing, but re-tie to be explicit
    model.init_weights(seed=seed)
    return model


def load_model(
    name_or_path: str,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    backend: str = "auto",
):
    """A preset name (random init with a fixed seed) or a local HF model directory, in
    ``dtype`` (None: float32).

    backend: "auto" uses our decoder for the model types of models/families/ (Llama, Mistral,
    Qwen2/3, Qwen3-MoE, Mixtral, Qwen3.5 dense and MoE, Qwen3-Next, DeepSeek-V2/V3, GPT-OSS,
    Qwen2.5-VL with its vision encoder) and falls back, with a one-line notice on stderr, to
    transformers' AutoModelForCausalLM (slower; same forward/forward_packed/save_pretrained interface, see hf_fallback.py) for
    anything else; "native" or "hf" force one.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if backend not in ("auto", "native", "hf"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'native' or 'hf'")
    if name_or_path in PRESETS:
        if backend == "hf":
            raise ValueError("presets are built with our decoder; backend='hf' needs a directory")
        return build_model(preset_config(name_or_path), dtype=dtype, device=device)
    if not os.path.isdir(name_or_path):
        raise ConfigError(
            [
                f"{name_or_path!r} is neither a preset ({sorted(PRESETS)}) nor a local directory "
                "(no downloads: point to a directory holding config.json and *.safetensors)"
            ]
        )
    from hybridflow.models.checkpoint_io.hf_checkpoint import load_model_from_dir, read_hf_config

    hf_config = read_hf_config(name_or_path)  # its values checked, whichever backend builds it
    if backend == "auto":
        problem = native_support_problem(hf_config)
        if problem is not None and hf_config.get("model_type") in VISION_MODEL_TYPES:
            # transformers' causal-LM fallback has no vision model: nothing else could load it
            raise ModelConfigError(config_values_message(
                [problem.removeprefix("config.json: ")], os.path.join(name_or_path, "config.json")
            ))  # fmt: skip
        backend = "native" if problem is None else "hf"
        if problem is not None:
            print(
                f"hybridflow: {name_or_path}: {problem}; loading it through transformers "
                "(slower: padded training, rollout with HF generate)",
                file=sys.stderr,
            )
    if backend == "native":
        return load_model_from_dir(name_or_path, dtype=dtype, device=device)
    from hybridflow.models.checkpoint_io.hf_fallback import load_hf_model

    return load_hf_model(name_or_path, dtype=dtype, device=device)


def native_support_problem(hf_config: dict) -> str | None:
    """Why our decoder cannot run this config.json (one short clause), or None if it can."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        kind = _unsupported_router(hf_config)
        detail = f" ({kind})" if kind else ""
        return f"model_type {model_type!r}{detail} is not in our decoder"
    if hf_config.get("hidden_act", "silu") != "silu" or hf_config.get("mlp_bias", False):
        return f"hidden_act={hf_config.get('hidden_act')!r} or mlp_bias is not in our decoder"
    if float(hf_config.get("router_jitter_noise") or 0.0) > 0:
        return "router_jitter_noise (random router input scaling in training) is not in our decoder"
    try:
        ModelArchitecture.from_hf(hf_config)
    except ModelConfigError:
        raise  # a value no model can have: transformers cannot build it either
    except (ValueError, KeyError) as error:
        return f"config.json: {error}"
    return None


def _unsupported_router(hf_config: dict) -> str | None:
    """The mixture-of-experts feature a config names that our router lacks, if any."""
    if hf_config.get("n_group") or hf_config.get("topk_group"):
        return "grouped top-k routing (DeepSeek)"
    if hf_config.get("shared_expert_intermediate_size") or hf_config.get("n_shared_experts"):
        return "shared experts"
    if hf_config.get("num_experts") or hf_config.get("num_local_experts"):
        return "a mixture of experts our router does not implement"
    return None


def load_tokenizer(name_or_path: str):
    """HF tokenizer from a local directory (with its chat template), or the built-in
    character-level tokenizer for "char" and the tiny presets."""
    from hybridflow.models.tokenizer import load_tokenizer as _load

    return _load(name_or_path)
