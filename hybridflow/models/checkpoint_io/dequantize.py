"""Quantized checkpoint weights -> plain float tensors: pure functions, no I/O.

MXFP4 (OCP microscaling; GPT-OSS's experts): ``blocks`` uint8 [..., R, G, 16] holds two
e2m1 values a byte, the low nibble first; ``scales`` uint8 [..., R, G] holds one e8m0
exponent (bias 127) per 32 values. Value = E2M1[nibble] * 2**(scale - 127); the row is
the G blocks of 32 in order, so the result is [..., R, 32 G].

Block-scaled FP8 (DeepSeek-V3/R1, Kimi-K2): ``weight`` float8_e4m3fn [..., R, C] and
``scale_inv`` [..., ceil(R / bm), ceil(C / bn)], one multiplier per bm x bn block (the
last row and column of blocks may be partial). Value = weight * scale_inv of its block.

Both compute in fp32 and round once to the asked dtype, a chunk of rows at a time so the
temporaries stay small next to the result (the largest checkpoint tensor).
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
"""The 16 e2m1 codes: sign bit 3, two exponent bits, one mantissa bit."""

E8M0_BIAS = 127
MXFP4_BLOCK = 32
"""Values sharing one e8m0 scale (16 bytes of blocks)."""

CHUNK_ELEMENTS = 1 << 22
"""Output elements dequantised at a time (16 MB of fp32 temporaries)."""


def mxfp4_to_float(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 ``blocks`` [..., R, G, B] (uint8) and ``scales`` [..., R, G] (uint8 e8m0) ->
    [..., R, G * 2B] in ``dtype``. Every e2m1 value times a power of two is exact in bf16."""
    if blocks.element_size() != 1 or scales.element_size() != 1:
        raise ValueError(f"MXFP4 blocks and scales are bytes, not {blocks.dtype} and "
                         f"{scales.dtype}")  # fmt: skip
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} "
                         "differ before the last dimension")  # fmt: skip
    *lead, groups, width = blocks.shape
    rows_in = blocks.reshape(-1, width).view(torch.uint8)  # [rows, B]
    # 2**(scale - 127) is exact in fp32 for every e8m0 byte but 255 (NaN; inf here)
    multipliers = torch.ldexp(torch.ones(rows_in.shape[0], 1, device=blocks.device),
                              scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS)  # fmt: skip
    pairs = _byte_pairs(blocks.device)  # a byte -> its (low, high) values: one gather a byte
    out = torch.empty(rows_in.shape[0], 2 * width, dtype=dtype, device=blocks.device)
    step = max(1, CHUNK_ELEMENTS // (2 * width))
    for start in range(0, rows_in.shape[0], step):
        values = pairs[rows_in[start : start + step].long()].flatten(-2)  # [rows, 2B]
        out[start : start + step] = values.mul_(multipliers[start : start + step])
    return out.reshape(*lead, groups * 2 * width)


def _byte_pairs(device) -> torch.Tensor:
    """[256, 2] fp32: the e2m1 values of a byte's low and high nibble."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    codes = torch.arange(256, device=device)
    return torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1)


def mxfp4_experts_to_float(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """GPT-OSS's stored experts: ``blocks`` [E, R, G, B], ``scales`` [E, R, G] -> [E, 2GB, R]
    (transposed, as its experts multiply ``x @ W[e]``: gate_up_proj [E, H, 2I] from blocks
    of [E, 2I, H/32, 16]), one expert at a time."""
    problem = mxfp4_shape_problem(tuple(blocks.shape), tuple(scales.shape))
    if problem:
        raise ValueError(problem)
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, groups * 2 * width, rows, dtype=dtype, device=blocks.device)
    for expert in range(experts):
        out[expert] = mxfp4_to_float(blocks[expert], scales[expert], dtype).T
    return out


def mxfp4_shape_problem(blocks: tuple[int, ...], scales: tuple[int, ...]) -> str | None:
    """Why MXFP4 expert ``blocks`` and ``scales`` of these shapes cannot be dequantised
    together (None: they can); read from the headers by validate, and by the loader."""
    if len(blocks) != 4:
        return f"MXFP4 expert blocks are [experts, rows, groups, 16], not {list(blocks)}"
    if blocks[:-1] != scales:
        return (f"MXFP4 blocks {list(blocks)} and scales {list(scales)} differ before the "
                "last dimension")  # fmt: skip
    return None


def fp8_shape_problem(
    weight: tuple[int, ...], scale_inv: tuple[int, ...], block: tuple[int, int]
) -> str | None:
    """Why an FP8 ``weight`` and its ``scale_inv`` of these shapes do not fit ``block``
    (None: they do): one multiplier per block, the last row and column of blocks partial."""
    if len(weight) < 2:
        return f"an FP8 weight in blocks is [..., rows, columns], not {list(weight)}"
    block_rows, block_cols = block
    grid = (-(-weight[-2] // block_rows), -(-weight[-1] // block_cols))
    if scale_inv != (*weight[:-2], *grid):
        return (f"weight {list(weight)} in {block_rows}x{block_cols} blocks needs scale_inv "
                f"{[*weight[:-2], *grid]}, not {list(scale_inv)}")  # fmt: skip
    return None


def fp8_scales_to_float(scale_inv: torch.Tensor) -> torch.Tensor:
    """Block multipliers as fp32: float scales as they are; uint8 ones are e8m0 exponents."""
    if scale_inv.dtype == torch.uint8:
        exponents = scale_inv.to(torch.int32) - E8M0_BIAS
        return torch.ldexp(torch.ones(exponents.shape, device=scale_inv.device), exponents)
    return scale_inv.to(torch.float32)


def fp8_blocks_to_float(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Block-scaled FP8 ``weight`` [..., R, C] with ``scale_inv`` [..., ceil(R/bm),
    ceil(C/bn)] for ``block`` = (bm, bn) -> [..., R, C] in ``dtype``; a few rows of blocks
    at a time."""
    problem = fp8_shape_problem(tuple(weight.shape), tuple(scale_inv.shape), block)
    if problem:
        raise ValueError(problem)
    block_rows, block_cols = block
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    multipliers = fp8_scales_to_float(scale_inv)
    full = cols // block_cols  # whole blocks a row; the columns after them: a partial one
    step = max(1, CHUNK_ELEMENTS // (block_rows * cols))  # rows of blocks a chunk
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    for first in range(0, grid[0], step):
        chunk = slice(first * block_rows, (first + step) * block_rows)
        values = weight[..., chunk, :].to(torch.float32)  # [..., r, C]
        row_scales = multipliers[..., first : first + step, :].repeat_interleave(block_rows, -2)
        row_scales = row_scales[..., : values.shape[-2], :]  # [..., r, blocks]
        blocked = values[..., : full * block_cols].unflatten(-1, (full, block_cols))
        blocked.mul_(row_scales[..., :full, None])
        values[..., full * block_cols :].mul_(row_scales[..., full:])
        out[..., chunk, :] = values
    return out
