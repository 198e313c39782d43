"""Read Hugging Face checkpoints into our decoder: config.json + safetensors (single or
sharded). Writing them is hf_writer.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from hybridflow.errors import UserError
from hybridflow.model_config_values import ModelConfigError
from hybridflow.models.architecture import ModelArchitecture
from hybridflow.models.checkpoint_io import expert_checkpoint
from hybridflow.models.checkpoint_io.finite_weights import check_finite
from hybridflow.models.checkpoint_io.quantized_checkpoint import (
    dequantized_tensors,
    quantization_problem,
    weight_quantization,
)
from hybridflow.models.checkpoint_io.weight_files import checkpoint_files
from hybridflow.models.families import family_hook, read_tensor
from hybridflow.models.llama import CausalLM


def announce_text_only(path: str) -> None:
    """One line on stderr: a multimodal checkpoint without its encoder (no vision_config)
    runs as its language model alone."""
    import sys

    print(
        f"hybridflow: {path}: a multimodal checkpoint without a vision_config; its language "
        "model is loaded",
        file=sys.stderr,
    )


def announce_not_loaded(hf_config: dict, path: str, skipped: list[str]) -> None:
    """One line on stderr naming the parts of the checkpoint its family left out
    (``skipped``: the tensor names not loaded)."""
    import sys

    note = family_hook(hf_config, "not_loaded_note")
    line = note(hf_config, skipped) if note is not None and skipped else None
    if line:
        print(f"hybridflow: {path}: {line}", file=sys.stderr)


def check_weight_format(hf_config: dict, path: str) -> None:
    """UserError when config.json describes weights the decoder cannot read (a quantization
    it does not dequantise: quantized_checkpoint.py)."""
    problem = quantization_problem(hf_config, os.path.join(path, "config.json"))
    if problem:
        raise UserError(problem)


def read_hf_config(path: str) -> dict:
    """config.json of the model directory ``path`` (ModelConfigError naming the file and
    line when it is not a JSON object, or the key of a value no model can have)."""
    from hybridflow.model_config_values import check_config_values
    from hybridflow.models.checkpoint_io.loadability import CONFIG_FILE, read_config_json

    config = read_config_json(path)
    check_config_values(config, os.path.join(path, CONFIG_FILE))
    return config


def safetensors_problem(file: str | os.PathLike) -> str | None:
    """Why ``file`` is not a complete safetensors file (truncated, bad header), or None.
    Reads the header only: 8 bytes of length, then JSON with each tensor's byte range, dtype
    and shape, which the safetensors library checks (no overlap, sizes that fit the shape)."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as handle:
            header_length = int.from_bytes(handle.read(8), "little")
            if size < 8 or 8 + header_length > size:
                return f"{file} is truncated or not a safetensors file ({size} bytes)"
            header = json.loads(handle.read(header_length))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
        return f"{file} cannot be read as safetensors ({str(error)[:200]})"
    if not isinstance(header, dict):
        return (
            f"{file} cannot be read as safetensors (its header is a JSON {type(header).__name__})"
        )
    ends = [_data_end(info) for name, info in header.items() if name != "__metadata__"]
    expected = 8 + header_length + max(ends, default=0)
    if size < expected:
        return f"{file} is truncated: {size} bytes on disk, its header describes {expected}"
    try:
        with safe_open(str(file), framework="pt"):
            pass  # the library's own header checks: dtypes, shapes, byte ranges
    except Exception as error:  # SafetensorError, and whatever a malformed header raises
        return f"{file} cannot be read as safetensors ({str(error)[:300]})"
    return None


def _data_end(info) -> int:
    """Where a header entry's bytes end (0 when it gives no byte range: the library says so)."""
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if isinstance(offsets, list) and len(offsets) == 2 and isinstance(offsets[1], int):
        return offsets[1]
    return 0


def iter_checkpoint_tensors(
    path: str, dtype: torch.dtype = torch.bfloat16
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every tensor in the checkpoint, one at a time; quantized
    weights (config.json's quantization_config) come dequantised to ``dtype`` under the
    names they load into. A tensor holding a NaN or an inf is refused (UserError naming it)."""
    files = checkpoint_files(path)
    for file in files:
        problem = safetensors_problem(file)
        if problem is not None:
            raise UserError(problem, "copy the model directory again (a download cut short?)")
    config = read_hf_config(path) if os.path.exists(os.path.join(path, "config.json")) else {}
    check_weight_format(config, path)
    quantization = weight_quantization(config)
    if quantization is None:
        stream = _plain_tensors(files)
    else:
        stream = dequantized_tensors(files, quantization, dtype, path)
    for name, tensor, file in stream:
        check_finite(name, tensor, file)
        yield name, tensor


def _plain_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor, str]]:
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name), file


def load_model_from_dir(
    path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_labels: int | None = None,
) -> CausalLM:
    """Build the model on the meta device (no memory), then put each checkpoint tensor in place
    as it is read (cast + moved once), so peak memory is one copy of the weights. Experts are
    read per expert or packed (expert_checkpoint.py). num_labels: the sequence-classification
    variant (``score.weight`` instead of ``lm_head.weight``)."""
    from hybridflow.models.checkpoint_io.loadability import native_weight_problems

    hf_config = read_hf_config(path)
    check_weight_format(hf_config, path)
    problems = native_weight_problems(path, hf_config, num_labels)  # the headers, as validate
    if problems:
        raise ModelConfigError(problems[0])
    config = ModelArchitecture.from_hf(hf_config)
    if isinstance(hf_config.get("text_config"), dict) and config.vision is None:  # text only
        announce_text_only(path)
    with torch.device("meta"):
        model = CausalLM(config, num_labels=num_labels)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    expected = set(shapes)
    scorer = num_labels is not None
    if config.tie_word_embeddings and not scorer:
        expected.discard("lm_head.weight")
    state: dict[str, torch.Tensor] = {}
    slices_read: set[tuple[str, int, str]] = set()
    skipped: list[str] = []

    def place(name: str, tensor: torch.Tensor) -> None:
        target, expert, part = expert_checkpoint.memory_name(name)
        if expert is not None and target in expected:
            if target not in state:
                state[target] = torch.empty(shapes[target], dtype=dtype, device=device)
            expert_checkpoint.place_expert_slice(state[target], expert, part, tensor)
            slices_read.add((target, expert, part))
        elif target in expected:
            state[target] = tensor.to(device=device, dtype=dtype)
        elif not ((config.tie_word_embeddings or scorer) and name == "lm_head.weight"):
            # Unused extras (e.g. rotary inv_freq buffers of old checkpoints) are skipped.
            if not name.endswith("rotary_emb.inv_freq"):
                raise ModelConfigError(f"checkpoint tensor {name!r} of {path} has no place "
                                       f"in {config.model_type}")  # fmt: skip

    dequantize_to = dtype if dtype.is_floating_point else torch.bfloat16
    for stored_name, stored in iter_checkpoint_tensors(path, dequantize_to):
        pairs = read_tensor(config, stored_name, stored)  # renamed, split; none: not run
        if not pairs:
            skipped.append(stored_name)
        for name, tensor in pairs:
            place(name, tensor)
    announce_not_loaded(hf_config, path, skipped)
    missing = sorted(expected - set(state))
    assembled = sorted({target for target, _, _ in slices_read})
    missing_slices = expert_checkpoint.expert_slices_expected(assembled, config.num_experts)
    missing += sorted(f"{n} expert {e} {p}" for n, e, p in missing_slices - slices_read)
    if missing:
        raise ModelConfigError(f"checkpoint {path!r} lacks {len(missing)} tensors, e.g. "
                               f"{missing[:5]}")  # fmt: skip
    if config.tie_word_embeddings and not scorer:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    return model
