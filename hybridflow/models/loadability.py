"""Whether a Hugging Face model directory can load, told without loading its weights.

``hybridflow config validate`` and the checks before ``train`` read the directory's
config.json (it must parse as a JSON object) and its architecture (one our decoder
implements, else one transformers builds as a causal LM); for our decoder, the safetensors
headers must hold every tensor it needs, in its shape. That the weight files are complete and
the tokenizer files present is checked beside this, in trainer/preflight.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.errors import UserError
from hybridflow.models.architecture import SUPPORTED_MODEL_TYPES
from hybridflow.safetensors_headers import stored_shapes

CONFIG_FILE = "config.json"


class ModelConfigError(UserError, ValueError):
    """config.json cannot be read; ``str()`` says which file and why."""


def read_config_json(model_dir: str | Path) -> dict:
    """The parsed config.json of ``model_dir``; ModelConfigError naming the file, the line
    and what is wrong when it is not a JSON object."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ModelConfigError(f"{path} is not UTF-8 text") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ModelConfigError(
            f"{path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})"
        ) from None
    except RecursionError:  # brackets nested thousands deep
        raise ModelConfigError(f"{path} is nested too deeply to be a model config") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path} must hold a JSON object, not a {type(config).__name__}")
    return config


def architecture_problem(config: dict, path: str | Path) -> str | None:
    """None when our decoder or transformers can build the model ``config`` describes as a
    causal LM; else why not (the names it gives and what is known)."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        architectures = [architectures]
    if model_type in SUPPORTED_MODEL_TYPES:
        return None
    causal_lm = _transformers_causal_lm()  # model_type -> its *ForCausalLM class name
    if causal_lm is None:
        return None  # transformers is not importable here: the loading will say so
    if model_type in causal_lm or any(name in causal_lm.values() for name in architectures):
        return None
    named = f"model_type {model_type!r}" if model_type else "no model_type"
    if architectures:
        named += f" and architectures {architectures}"
    return (
        f"{Path(path) / CONFIG_FILE} names {named}, which neither hybridflow's decoder "
        f"({', '.join(SUPPORTED_MODEL_TYPES)}) nor this transformers' causal LMs can build "
        f"(no model code is downloaded or run): use a causal language model of a known "
        f"architecture, or upgrade transformers if it is newer than this one"
    )


def _transformers_causal_lm() -> dict[str, str] | None:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def config_problems(model_dir: str | Path) -> list[str]:
    """config.json of ``model_dir`` parses and names a buildable architecture ([] if so)."""
    try:
        config = read_config_json(model_dir)
    except ModelConfigError as error:
        return [f"{error}: copy the model directory again, or fix the file"]
    problem = architecture_problem(config, model_dir)
    if problem:
        return [problem]
    if config.get("model_type") in SUPPORTED_MODEL_TYPES:
        from hybridflow.models.families import family_hook

        problem = family_hook(config, "checkpoint_problem")
        message = problem(config, str(Path(model_dir) / CONFIG_FILE)) if problem else None
        return [message] if message else native_weight_problems(model_dir, config)
    return []


def native_weight_problems(model_dir: str | Path, config: dict) -> list[str]:
    """The safetensors headers of ``model_dir`` hold each tensor our decoder needs for
    ``config``, in its shape ([] if so, or if a file is unreadable: reported elsewhere)."""
    import torch

    from hybridflow.models.architecture import ModelArchitecture
    from hybridflow.models.llama import CausalLM

    try:
        architecture = ModelArchitecture.from_hf(config)
    except (ValueError, KeyError, TypeError):
        return []  # not for our decoder: transformers' fallback reads it
    with torch.device("meta"):  # shapes only, no memory
        expected = {k: tuple(v.shape) for k, v in CausalLM(architecture).state_dict().items()}
    if architecture.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    stored = _stored_shapes(Path(model_dir), architecture)
    if stored is None:
        return []
    config_file = Path(model_dir) / CONFIG_FILE
    missing = sorted(set(expected) - set(stored))
    if missing:
        return [
            f"the weights in {model_dir} lack {len(missing)} tensors the model of {config_file} "
            f"needs (e.g. {', '.join(missing[:3])}): the weights belong to another model, or "
            f"a shard is missing; copy the model directory again"
        ]
    wrong = [(k, stored[k], shape) for k, shape in expected.items() if stored[k] != shape]
    if wrong:
        name, found, shape = wrong[0]
        return [
            f"the weights in {model_dir} do not fit {config_file}: {len(wrong)} tensors have "
            f"another shape (e.g. {name} is {list(found)}, the config makes it {list(shape)}); "
            f"the config.json belongs to another model: copy the model directory again"
        ]
    return []


def _stored_shapes(model_dir: Path, architecture) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from every safetensors header, under the names the model loads
    into; None if any header is unreadable."""
    shapes = stored_shapes(model_dir)
    if shapes is None:
        return None
    import torch

    from hybridflow.models.expert_checkpoint import shapes_in_memory
    from hybridflow.models.families import read_tensor

    # each stored tensor as the names and shapes it loads into (meta tensors: no memory)
    shapes = {
        name: tuple(tensor.shape)
        for stored, shape in shapes.items()
        for name, tensor in read_tensor(architecture, stored, torch.empty(shape, device="meta"))
    }
    return shapes_in_memory(shapes)  # one tensor per expert -> the packed names we load into
