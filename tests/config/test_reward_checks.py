"""Reward-model checks that read headers only: a quantized checkpoint's parameters are
counted as they load, dequantised (MXFP4 blocks hold two values a byte, scales none)."""

import json

import torch
from safetensors.torch import save_file

from hybridflow.config.reward_checks import stored_parameter_count


def test_mxfp4_blocks_count_as_the_weights_they_make_and_scales_not_at_all(tmp_path):
    tensors = {"score.weight": torch.zeros(1, 64),
               "model.layers.0.mlp.experts.down_proj_blocks": torch.zeros(4, 64, 2, 16, dtype=torch.uint8),
               "model.layers.0.mlp.experts.down_proj_scales": torch.zeros(4, 64, 2, dtype=torch.uint8)}  # fmt: skip
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert stored_parameter_count(tmp_path) == 64 + 4 * 64 * 2 * 16 + 4 * 64 * 2
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert stored_parameter_count(tmp_path) == 64 + 4 * 64 * 64  # [E, 64, 64] dequantised
