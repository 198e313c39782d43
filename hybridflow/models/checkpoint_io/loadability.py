"""Whether a Hugging Face model directory can load, told without loading its weights.

``hybridflow config validate`` and the checks before ``train`` read the directory's
config.json (it must parse as a JSON object) and its architecture (one our decoder
implements, else one transformers builds as a causal LM); for our decoder, the safetensors
headers must hold every tensor it needs, in its shape. That the weight files are complete and
the tokenizer files present is checked beside this, in trainer/lifecycle/preflight.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.errors import UserError
from hybridflow.model_config_values import (
    VISION_MODEL_TYPES,
    ModelConfigError,
    config_value_problems,
    config_values_message,
)
from hybridflow.models.architecture import SUPPORTED_MODEL_TYPES
from hybridflow.models.checkpoint_io.weight_files import checkpoint_files
from hybridflow.safetensors_headers import stored_dtypes, stored_shapes

if TYPE_CHECKING:
    from hybridflow.models.checkpoint_io.quantized_checkpoint import WeightQuantization

CONFIG_FILE = "config.json"


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
    if not isinstance(model_type, str | None) or not all(isinstance(n, str) for n in architectures):
        return (
            f"{Path(path) / CONFIG_FILE}: model_type = {json.dumps(model_type)[:40]} and "
            f"architectures = {json.dumps(architectures)[:60]} must be strings naming the "
            f'architecture (e.g. "qwen2" and ["Qwen2ForCausalLM"]): correct them in '
            f"config.json, or copy the model directory again"
        )
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


def config_problems(model_dir: str | Path, num_labels: int | None = None) -> list[str]:
    """config.json of ``model_dir`` parses, names a buildable architecture and holds values
    a model can have; the weights fit it ([] if so). num_labels: a sequence classifier's
    score head (a reward model) instead of the lm_head."""
    try:
        config = read_config_json(model_dir)
    except ModelConfigError as error:
        return [f"{error}: copy the model directory again, or fix the file"]
    problem = architecture_problem(config, model_dir)
    if problem:
        return [problem]
    problems = config_value_problems(config) or transformers_name_problems(config)
    if (
        problems
    ):  # the words a model load says (models/checkpoint_io/hf_checkpoint.py read_hf_config)
        return [config_values_message(problems, Path(model_dir) / CONFIG_FILE)]
    if config.get("model_type") in SUPPORTED_MODEL_TYPES:
        from hybridflow.models.checkpoint_io.quantized_checkpoint import quantization_problem

        message = quantization_problem(config, str(Path(model_dir) / CONFIG_FILE))
        return [message] if message else native_weight_problems(model_dir, config, num_labels)
    return []


OUR_ROPE_TYPES = ("default", "mrope")  # besides transformers' (mrope: Qwen2.5-VL's sections)


def transformers_name_problems(config: dict) -> list[str]:
    """hidden_act and the RoPE type must name functions transformers has: a model our decoder
    does not run is built by transformers' fallback, which looks them up by these names (an
    unknown one was a KeyError deep inside the build)."""
    config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    problems = []
    activation = config.get("hidden_act")
    if isinstance(activation, str) and activation != "silu":
        from transformers.activations import ACT2CLS

        if activation not in ACT2CLS:
            problems.append(f"hidden_act = {activation!r} is not an activation transformers "
                            f"has ({', '.join(sorted(ACT2CLS))})")  # fmt: skip
    for section in ("rope_scaling", "rope_parameters"):
        value = config.get(section)
        for part in (value, *value.values()) if isinstance(value, dict) else ():
            kind = part.get("rope_type", part.get("type")) if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in OUR_ROPE_TYPES:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                if kind not in ROPE_INIT_FUNCTIONS:
                    known = ", ".join((*OUR_ROPE_TYPES, *ROPE_INIT_FUNCTIONS))
                    problems.append(f"{section} rope_type = {kind!r} is not a RoPE scaling "
                                    f"transformers has ({known})")  # fmt: skip
    return problems


def native_weight_problems(
    model_dir: str | Path, config: dict, num_labels: int | None = None
) -> list[str]:
    """The safetensors headers of ``model_dir`` hold each tensor our decoder needs for
    ``config``, in its shape, and none it has no place for ([] if so, or if a file is
    unreadable: reported elsewhere). The loader says the same before it reads a weight."""
    from hybridflow.models.architecture import ModelArchitecture
    from hybridflow.models.checkpoint_io.quantized_checkpoint import (
        unpaired_problem,
        weight_quantization,
    )

    try:
        architecture = ModelArchitecture.from_hf(config)
        quantization = weight_quantization(config)
    except (ValueError, KeyError, TypeError) as error:
        if config.get("model_type") in VISION_MODEL_TYPES:  # no fallback loads these
            return [config_values_message([str(error)], Path(model_dir) / CONFIG_FILE)]
        return []  # not for our decoder (transformers' fallback reads it), or said before
    problem = _quantized_pair_problem(Path(model_dir), quantization) or _dtype_problem(
        Path(model_dir), quantization
    )
    if problem:
        return [problem]
    stored = _stored_shapes(Path(model_dir), architecture, quantization)
    if stored is None:
        return []
    unpaired = unpaired_problem(stored, quantization, model_dir)
    if unpaired:
        return [unpaired]
    config_file = Path(model_dir) / CONFIG_FILE
    layers = stored_layer_count(stored)
    if architecture.num_hidden_layers > layers:  # said before a model of that depth is built
        return [
            f"the weights in {model_dir} hold {layers} decoder layers, the model of "
            f"{config_file} has num_hidden_layers = {architecture.num_hidden_layers} (no "
            f"model.layers.{layers}.*): the weights belong to another model, or a shard is "
            f"missing; copy the model directory again"
        ]
    expected = expected_shapes(architecture, num_labels)
    missing = sorted(set(expected) - set(stored))
    if missing:
        return [_missing_message(model_dir, config_file, len(missing), missing)]
    wrong = [(k, stored[k], shape) for k, shape in expected.items() if stored[k] != shape]
    if wrong:
        name, found, shape = wrong[0]
        return [
            f"the weights in {model_dir} do not fit {config_file}: {len(wrong)} tensors have "
            f"another shape (e.g. {name} is {list(found)}, the config makes it {list(shape)}); "
            f"the config.json belongs to another model: copy the model directory again"
        ]
    unused = sorted(
        k for k in set(stored) - set(expected) if not _ignored(k, architecture, num_labels)
    )
    if unused:
        return [
            f"the weights in {model_dir} hold {len(unused)} tensors the model of {config_file} "
            f"has no place for (e.g. {', '.join(unused[:3])}): the weights belong to another "
            f"model or architecture; copy the model directory again"
        ]
    return []


def expected_shapes(architecture, num_labels: int | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor our decoder loads for ``architecture`` (a tied lm_head
    is not stored), computed on the meta device: no memory."""
    import torch

    from hybridflow.models.llama import CausalLM

    with torch.device("meta"):
        model = CausalLM(architecture, num_labels=num_labels)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if architecture.tie_word_embeddings and num_labels is None:
        expected.pop("lm_head.weight", None)
    return expected


def stored_layer_count(stored: dict[str, tuple[int, ...]]) -> int:
    """Decoder layers the checkpoint holds tensors of (``model.layers.<i>.``, highest i + 1)."""
    indices = [int(m.group(1)) for name in stored if (m := _LAYER.match(name))]
    return max(indices, default=-1) + 1


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _ignored(name: str, architecture, num_labels: int | None) -> bool:
    """Tensors a checkpoint may hold that the loader skips: old rotary inv_freq buffers,
    and the lm_head of a tied model or of a sequence classifier."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and (architecture.tie_word_embeddings or num_labels is not None)


def _missing_message(model_dir, config_file, count: int, names: list[str]) -> str:
    return (
        f"the weights in {model_dir} lack {count} tensors the model of {config_file} "
        f"needs (e.g. {', '.join(names[:3])}): the weights belong to another model, or "
        f"a shard is missing; copy the model directory again"
    )


def _quantized_pair_problem(model_dir: Path, quantization) -> str | None:
    """A quantized tensor and its scales whose header shapes do not fit each other."""
    from hybridflow.models.checkpoint_io.quantized_checkpoint import pair_shape_problem

    if quantization is None:
        return None
    try:
        shapes = stored_shapes(model_dir, checkpoint_files(str(model_dir)))
    except (OSError, UserError):
        return None  # said by the file checks
    return pair_shape_problem(shapes, quantization, model_dir) if shapes else None


def _dtype_problem(model_dir: Path, quantization) -> str | None:
    """A tensor stored in a type no weight is read from: integers outside the quantized
    tensors (a float weight cast to int has lost its values, and the loader would cast it
    back silently), or MXFP4 blocks and scales that are not bytes."""
    from hybridflow.models.checkpoint_io.quantized_checkpoint import (
        MXFP4,
        MXFP4_BLOCKS,
        MXFP4_SCALES,
    )

    try:
        dtypes = stored_dtypes(model_dir, checkpoint_files(str(model_dir)))
    except (OSError, UserError):
        return None  # said by the file checks
    mxfp4 = quantization is not None and quantization.method == MXFP4

    def quantized(name: str) -> bool:  # a quantized tensor or its scales (paired or not)
        if quantization is None:
            return False
        if quantization.is_companion(name) or (mxfp4 and name.endswith(MXFP4_BLOCKS)):
            return True
        return not mxfp4 and quantization.companion(name) in dtypes

    wrong = sorted(
        (name, dtype) for name, dtype in (dtypes or {}).items()
        if (dtype != "U8" if mxfp4 and quantized(name)
            else not quantized(name) and not dtype.startswith(("F", "BF")))
    )  # fmt: skip
    if not wrong:
        return None
    if quantization is None and wrong[0][0].endswith((MXFP4_BLOCKS, MXFP4_SCALES)):
        return (
            f"the weights in {model_dir} hold MXFP4 blocks and scales (e.g. {wrong[0][0]}), but "
            f"{model_dir / CONFIG_FILE} has no quantization_config: add "
            '"quantization_config": {"quant_method": "mxfp4"} to it (as the released GPT-OSS '
            "has), or copy the model directory again"
        )
    examples = ", ".join(f"{name} is {dtype}" for name, dtype in wrong[:3])
    return (
        f"the weights in {model_dir} hold {len(wrong)} tensors of a type no weight is read "
        f"from (e.g. {examples}; weights are floating point: F32, BF16, F16, and MXFP4 "
        f"blocks and scales are U8): the file was damaged or converted wrongly; copy the "
        f"model directory again"
    )


def _stored_shapes(
    model_dir: Path, architecture, quantization: WeightQuantization | None = None
) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from the headers of the safetensors files the loader reads (the
    index's shards, else model.safetensors: a repository's other files, such as Mistral's
    consolidated.safetensors, are not read), under the names and shapes the model loads
    (quantized weights as dequantised: quantized_checkpoint.loaded_shapes); None if a header
    or the index is unreadable."""
    try:
        files = checkpoint_files(str(model_dir))
    except (OSError, UserError):
        return None  # no weights, or an index that does not parse: said by the file checks
    shapes = stored_shapes(model_dir, files)
    if shapes is None:
        return None
    import torch

    from hybridflow.models.checkpoint_io.expert_checkpoint import shapes_in_memory
    from hybridflow.models.checkpoint_io.quantized_checkpoint import loaded_shapes
    from hybridflow.models.families import read_tensor

    # each stored tensor as the names and shapes it loads into (meta tensors: no memory)
    shapes = {
        name: tuple(tensor.shape)
        for stored, shape in loaded_shapes(shapes, quantization).items()
        for name, tensor in read_tensor(architecture, stored, torch.empty(shape, device="meta"))
    }
    return shapes_in_memory(shapes)  # one tensor per expert -> the packed names we load into
