"""How the fp8 rollout (matmul.py) quantizes a projection's weight: with the engine's own scales,
or with the FP8 trainer's recipe (torchao's float8 training, learners/fp8_training.py), so that
the e4m3 bytes and scales the rollout multiplies by are those of the trainer's forward.

The engine's own ("engine"): a scale per output channel, amax / 448 (fp32 times 1/448), the
row divided by it (e4m3.py).

The trainer's (torchao 0.18, ``float8_utils.amax_to_scale`` and ``_ToFloat8ConstrFunc``): torchao
keeps the multiplier s = 448 / max(amax, 1e-12), computed in float64 and rounded to fp32; the
e4m3 bytes are saturate(w.float() * s) (clamped to ±448, cast with round to nearest even), and
its matmul multiplies the product by 1/s (``s.reciprocal()`` in fp32, float8_ops.py), which is
the scale kept here.
- rowwise: the weight's amax over its input dim, one per output channel (the forward casts
  weight.t() along dim 0), and s rounded down to a power of two (exp2(floor(log2(s)))):
  the engine's own layout, another formula.
- tensorwise: one amax for the whole weight, no power-of-two rounding. The engine's matmul
  takes a scale per output channel (torch._scaled_mm takes both operands per row or both per
  tensor, and the activations are per row), so the tensor's scale is repeated on each of its
  rows: the same bytes and the same value per row, another kernel (cuBLAS's rowwise scaled mm
  instead of its tensorwise one). A fused copy (q/k/v concatenated, gate/up interleaved) keeps
  each source weight's own scale on that weight's rows.
"""

from __future__ import annotations

import torch

from hybridflow.engine.fp8.e4m3 import (
    E4M3,
    E4M3_MAX,
    TINY,
    quantize_rows_by_amax,
    quantize_rows_reference,
)
from hybridflow.engine.options import ENGINE_SCALES, TRAINER_RECIPES, WEIGHT_SCALES  # noqa: F401


def trainer_multiplier(amax: torch.Tensor, recipe: str) -> torch.Tensor:
    """torchao's s of ``amax`` (fp32, same shape): 448 / max(amax, 1e-12) in float64, rounded
    to fp32; rowwise rounds it down to a power of two."""
    if recipe not in TRAINER_RECIPES:
        raise ValueError(f"recipe {recipe!r}: must be one of {', '.join(TRAINER_RECIPES)}")
    multiplier = (E4M3_MAX / amax.to(torch.float64).clamp(min=TINY)).to(torch.float32)
    if recipe == "rowwise":
        multiplier = torch.exp2(torch.floor(torch.log2(multiplier)))
    return multiplier


def quantize_weight(
    weight: torch.Tensor, recipe: str, row_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], scale [N, 1] fp32) with weight ≈ e4m3 * scale per row.

    recipe: "engine" (e4m3.py's own per-row scales) or a trainer recipe (rowwise, tensorwise).
    row_amax [N, 1]: the amax each row's scale comes from (see :func:`amax_rows`): under
    tensorwise the whole source weight's, repeated on its rows (:func:`tensor_amax_rows`); on a
    tensor-parallel shard the whole weight's (its rows' or the tensor's). None: ``weight``'s
    own (each row's, or the whole tensor's under tensorwise)."""
    if recipe == ENGINE_SCALES:
        if row_amax is None:
            return quantize_rows_reference(weight)
        return quantize_rows_by_amax(weight, row_amax)
    wide = weight.to(torch.float32)
    if row_amax is not None:
        amax = row_amax
    elif recipe == "rowwise":
        amax = wide.abs().amax(dim=1, keepdim=True)
    else:
        amax = wide.abs().amax().expand(weight.shape[0], 1)
    multiplier = trainer_multiplier(amax, recipe)
    values = (wide * multiplier).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return values, multiplier.reciprocal()


def tensor_amax_rows(parts: list[torch.Tensor], interleaved: bool) -> torch.Tensor:
    """[N, 1]: each row of a fused copy of ``parts`` with the amax of the part it came from:
    parts concatenated along the rows (q/k/v), or interleaved row by row (gate_0, up_0,
    gate_1, ...: weights.FusedProjections)."""
    amaxes = [part.abs().amax().to(torch.float32) for part in parts]
    if interleaved:
        rows = torch.stack([amax.expand(part.shape[0]) for amax, part in zip(amaxes, parts)], 1)
        return rows.reshape(-1, 1)
    return torch.cat([amax.expand(part.shape[0]) for amax, part in zip(amaxes, parts)])[:, None]


def amax_rows(weight: torch.Tensor, parts: list[torch.Tensor], interleaved: bool,
              recipe: str) -> torch.Tensor:  # fmt: skip
    """[N, 1] fp32: the amax each row of ``weight`` (a fused copy of ``parts``, or one of them)
    takes its scale from, over what this process holds: its part's under tensorwise, its own
    row's otherwise. A tensor-parallel shard takes the MAX of these over its group (each rank's
    row i is of the same part, or the same output channel where the columns are split)."""
    if recipe == "tensorwise":
        return tensor_amax_rows(parts, interleaved)
    return weight.to(torch.float32).abs().amax(dim=1, keepdim=True)
