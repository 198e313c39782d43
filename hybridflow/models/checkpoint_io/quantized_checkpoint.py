"""Checkpoints whose weights are stored quantized (config.json's ``quantization_config``):
GPT-OSS's MXFP4 experts, DeepSeek-V3's and Kimi-K2's block-scaled FP8. The decoder reads
bf16/fp32 tensors only; such a checkpoint is named with what to do instead."""

from __future__ import annotations

from typing import Any


def quantized_checkpoint_problem(hf: dict[str, Any], config_file: str) -> str | None:
    """Why the weights ``config_file`` describes cannot be read (their quantization), or
    None when they are plain tensors."""
    quantization = hf.get("quantization_config")
    if not (isinstance(quantization, dict) and quantization.get("quant_method")):
        return None
    method = quantization["quant_method"]
    return (
        f"{config_file} describes {method} weights (quantization_config), which hybridflow's "
        "decoder does not read: dequantise them to bf16 first (load the model with "
        "transformers, dequantising, and save_pretrained), or use a bf16 copy of the checkpoint"
    )
