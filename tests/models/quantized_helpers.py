"""Reference quantisers for tests: a checkpoint written by transformers turned into the
layouts the released GPT-OSS (MXFP4 experts) and DeepSeek-V3 (block-scaled FP8) checkpoints
use, and the same checkpoint dequantised by transformers' own functions."""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.models.mla_moe_helpers import edit_config

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # fmt: skip
FP8_MAX = 448.0


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., C] (C a multiple of 32) -> blocks uint8 [..., C/32, 16], scales uint8
    [..., C/32]: a shared exponent per 32 values so the largest lands at most at 6
    (e2m1's top, 1.5 * 2**2), then each value rounded to the nearest e2m1 code; two codes
    a byte, the first in the low nibble."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    exponent = exponent.clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    codes = (scaled.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)  # nearest code
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]):
    """[R, C] -> (float8_e4m3fn [R, C], scale_inv fp32 [ceil(R/bm), ceil(C/bn)]): each
    block's largest value maps to e4m3's 448, partial blocks at the ends included."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = torch.empty(grid)
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = (
                slice(i * block[0], (i + 1) * block[0]),
                slice(j * block[1], (j + 1) * block[1]),
            )
            amax = weight[part].abs().max().clamp(min=1e-12)
            scale_inv[i, j] = amax / FP8_MAX
            quantized[part] = (weight[part] / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale_inv


def mxfp4_gpt_oss(directory: Path, dequantised: Path) -> None:
    """Rewrite the GPT-OSS checkpoint in ``directory`` with its experts in MXFP4 as the
    released ones are (``*_blocks`` [E, R, C/32, 16] of the transposed [E, R, C] weight,
    ``*_scales``); ``dequantised`` gets the same checkpoint with the experts as transformers
    dequantises those blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weights = load_file(directory / "model.safetensors")
    plain = dict(weights)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(weights.pop(name).transpose(1, 2))  # [E, H, 2I] -> rows 2I
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    _write(directory, weights, dequantised, plain)
    edit_config(directory, quantization_config={"quant_method": "mxfp4",
                                                "modules_to_not_convert": ["model.layers.*.self_attn"]})  # fmt: skip


def fp8_blocks(directory: Path, dequantised: Path, block: tuple[int, int]) -> None:
    """Rewrite the checkpoint in ``directory`` as DeepSeek-V3's (and Qwen3-FP8's) released
    ones are: every projection of the decoder layers (attention, dense, shared and routed
    experts; not the router, norms, embeddings or lm_head) in float8 e4m3 with
    ``weight_scale_inv`` per ``block``; ``dequantised`` gets it as transformers dequantises
    it."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weights = load_file(directory / "model.safetensors")
    plain = dict(weights)
    for name, tensor in list(weights.items()):
        if not _fp8_projection(name, tensor):
            continue
        quantized, scale_inv = quantize_fp8_blocks(tensor, block)
        weights[name], weights[f"{name}_scale_inv"] = quantized, scale_inv
        plain[name] = _dequantize_fp8_weight(quantized, scale_inv, list(block), torch.float32)
    _write(directory, weights, dequantised, plain)
    edit_config(directory, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                "activation_scheme": "dynamic",
                                                "weight_block_size": list(block)})  # fmt: skip


def _fp8_projection(name: str, tensor: torch.Tensor) -> bool:
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and "norm" not in name and not name.endswith("mlp.gate.weight"))  # fmt: skip


def _write(directory: Path, weights: dict, dequantised: Path, plain: dict) -> None:
    import shutil

    shutil.copytree(directory, dequantised)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, dequantised / "model.safetensors", metadata={"format": "pt"})
