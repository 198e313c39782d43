"""Checkpoints whose weights are stored quantized (config.json's ``quantization_config``),
read by dequantising each tensor as it is read (checkpoint_io/dequantize.py):

- ``quant_method = "mxfp4"`` (GPT-OSS): each expert weight ``X`` is stored as ``X_blocks``
  [E, R, G, 16] and ``X_scales`` [E, R, G]; it loads as ``X`` [E, 32 G, R].
- ``quant_method = "fp8"`` with ``weight_block_size`` [bm, bn] (DeepSeek-V3/R1, Kimi-K2):
  a weight ``X.weight`` is float8 e4m3 beside ``X.weight_scale_inv``; it loads as
  ``X.weight`` of the same shape.

A quantized tensor is read with its companion (from whichever shard holds it), so memory
stays one stored tensor and its result at a time. Any other ``quant_method`` is named as
one the decoder cannot read.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MXFP4, FP8 = "mxfp4", "fp8"
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP8_SCALE = "_scale_inv"


@dataclass(frozen=True)
class WeightQuantization:
    """How config.json says the checkpoint stores its weights."""

    method: str
    """MXFP4 or FP8."""
    block: tuple[int, int] | None = None
    """FP8: rows x columns sharing one scale (weight_block_size)."""

    def companion(self, name: str) -> str | None:
        """The scale tensor read with the quantized tensor ``name`` (None: not one)."""
        if self.method == MXFP4:
            stem = name.removesuffix(MXFP4_BLOCKS)
            return stem + MXFP4_SCALES if stem != name else None
        return name + FP8_SCALE

    def is_companion(self, name: str) -> bool:
        suffix = MXFP4_SCALES if self.method == MXFP4 else FP8_SCALE
        return name.endswith(suffix)

    def owner(self, companion: str) -> str:
        """The quantized tensor a scale tensor belongs to."""
        if self.method == MXFP4:
            return companion.removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS
        return companion.removesuffix(FP8_SCALE)

    def loaded_name(self, name: str) -> str:
        return name.removesuffix(MXFP4_BLOCKS) if self.method == MXFP4 else name

    def describe(self) -> str:
        if self.method == MXFP4:
            return "MXFP4 (e2m1 blocks with an e8m0 scale per 32 values)"
        return f"FP8 e4m3 in {self.block[0]}x{self.block[1]} blocks (weight_scale_inv)"


def quantization_problem(hf: dict[str, Any], config_file: str) -> str | None:
    """Why the weights ``config_file`` describes cannot be read (a quantization the decoder
    does not dequantise), or None: plain tensors, MXFP4, block-scaled FP8."""
    try:
        weight_quantization(hf)
    except ValueError as error:
        return f"{config_file}: {error}"
    return None


def weight_quantization(hf: dict[str, Any]) -> WeightQuantization | None:
    """The quantization config.json ``hf`` describes; None for plain tensors; ValueError
    for one that is not read."""
    quantization = hf.get("quantization_config")
    if not (isinstance(quantization, dict) and quantization.get("quant_method")):
        return None
    method = quantization["quant_method"]
    if method == MXFP4:
        return WeightQuantization(MXFP4)
    block = quantization.get("weight_block_size")
    if method == FP8 and _is_block(block):
        return WeightQuantization(FP8, (int(block[0]), int(block[1])))
    if method == FP8:
        raise ValueError(
            f"quantization_config describes fp8 weights with weight_block_size = {block!r}; "
            "hybridflow dequantises block-scaled FP8 only (weight_block_size [rows, columns], "
            "as DeepSeek-V3's): use a bf16 copy of the checkpoint"
        )
    raise ValueError(
        f"quantization_config describes {method} weights, which hybridflow's decoder does not "
        "read (it dequantises mxfp4 and block-scaled fp8): dequantise them to bf16 first (load "
        "the model with transformers, dequantising, and save_pretrained), or use a bf16 copy "
        "of the checkpoint"
    )


def _is_block(block) -> bool:
    return (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)
    )


def loaded_shapes(
    stored: dict[str, tuple[int, ...]], quantization: WeightQuantization | None
) -> dict[str, tuple[int, ...]]:
    """Stored name -> shape (safetensors headers) as the names and shapes the tensors load
    into: MXFP4 blocks [E, R, G, B] -> [E, 2GB, R], their scales dropped; FP8 scales dropped
    (a weight keeps its shape). A tensor whose companion is missing keeps its stored name,
    so the check that every tensor has a place names it."""
    if quantization is None:
        return dict(stored)
    shapes = {}
    for name, shape in stored.items():
        if quantization.is_companion(name) and quantization.owner(name) in stored:
            continue
        companion = quantization.companion(name)
        if companion is None or companion not in stored:
            shapes[name] = shape
        elif quantization.method == MXFP4 and len(shape) == 4:
            experts, rows, groups, width = shape
            shapes[quantization.loaded_name(name)] = (experts, groups * 2 * width, rows)
        else:
            shapes[quantization.loaded_name(name)] = shape
    return shapes


def unpaired_problem(
    loaded: dict[str, tuple[int, ...]], quantization: WeightQuantization | None, model_dir
) -> str | None:
    """Why the tensors :func:`loaded_shapes` left under their stored names cannot load: a
    quantized tensor without its scales, or scales without their tensor; None if none."""
    if quantization is None:
        return None
    names = sorted(
        name for name in loaded
        if quantization.is_companion(name)
        or (quantization.method == MXFP4 and name.endswith(MXFP4_BLOCKS))
    )  # fmt: skip
    if not names:
        return None
    return (
        f"the weights in {model_dir} hold {len(names)} tensors of {quantization.describe()} "
        f"without their pair (e.g. {', '.join(names[:3])}; a quantized tensor is stored "
        "with its scales): a shard is missing or damaged; copy the model directory again"
    )


def pair_shape_problem(
    stored: dict[str, tuple[int, ...]], quantization: WeightQuantization | None, model_dir
) -> str | None:
    """Why a quantized tensor and its scales, by their header shapes ``stored``, cannot be
    dequantised together (what the loader would find reading them); None if all fit."""
    from hybridflow.models.checkpoint_io.dequantize import fp8_shape_problem, mxfp4_shape_problem

    if quantization is None:
        return None
    for name, shape in stored.items():
        companion = quantization.companion(name)
        if companion is None or companion not in stored:
            continue
        if quantization.method == MXFP4:
            problem = mxfp4_shape_problem(shape, stored[companion])
        else:
            problem = fp8_shape_problem(shape, stored[companion], quantization.block)
        if problem:
            return (f"the weights in {model_dir}: tensor {name} and {companion} do not fit "
                    f"({problem}): copy the model directory again")  # fmt: skip
    return None


def dequantized_tensors(files: list[str], quantization: WeightQuantization, dtype,
                        source: str) -> Iterator[tuple[str, Any, str]]:  # fmt: skip
    """(name, tensor, file) of every tensor in ``files`` (safetensors), the quantized ones
    dequantised to ``dtype`` under the names they load into, each scale read with its
    tensor; one line on stderr says what was dequantised."""
    import torch
    from safetensors import safe_open

    from hybridflow.errors import UserError

    holder = {name: file for file in files for name in _names(file)}
    count = 0
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                if quantization.is_companion(name) and quantization.owner(name) in holder:
                    continue  # read with its tensor
                companion = quantization.companion(name)
                if companion is None or companion not in holder:
                    tensor = handle.get_tensor(name)
                    if quantization.method == FP8 and tensor.dtype == torch.float8_e4m3fn:
                        raise UserError(f"{file}: tensor {name} is float8 with no {companion} "
                                        "beside it", "copy the model directory again")  # fmt: skip
                    yield name, tensor, file
                    continue
                scales = _read(handle, file, holder[companion], companion)
                stored = handle.get_tensor(name)
                loaded = _dequantize(quantization, name, stored, scales, dtype, file)
                del stored, scales  # before the next tensor is read: one at a time
                yield quantization.loaded_name(name), loaded, file
                count += 1
    if count:
        print(f"hybridflow: {source}: {count} weight tensors dequantised from "
              f"{quantization.describe()} to {str(dtype).removeprefix('torch.')}",
              file=sys.stderr)  # fmt: skip


def _names(file: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as handle:
        return list(handle.keys())


def _read(handle, file: str, other_file: str, name: str):
    if other_file == file:
        return handle.get_tensor(name)
    from safetensors import safe_open

    with safe_open(other_file, framework="pt") as other:
        return other.get_tensor(name)


def _dequantize(quantization: WeightQuantization, name: str, stored, scales, dtype, file: str):
    from hybridflow.errors import UserError
    from hybridflow.models.checkpoint_io.dequantize import (
        fp8_blocks_to_float,
        mxfp4_experts_to_float,
    )

    try:
        if quantization.method == MXFP4:
            return mxfp4_experts_to_float(stored, scales, dtype)
        return fp8_blocks_to_float(stored, scales, quantization.block, dtype)
    except ValueError as error:
        raise UserError(f"{file}: tensor {name} and {quantization.companion(name)} do not "
                        f"fit ({error})", "copy the model directory again") from None  # fmt: skip
