"""torchao's Float8Linear, quantizing under autocast the weight's compute copy (imported only
by fp8_training.convert_to_fp8: torchao is an optional extra).

torchao's own forward casts the input to the autocast dtype and quantizes the weight as it
is: with fp32 masters on one device (autocast, no FSDP2), the fp32 master. The rollout
receives the bf16 copy of that weight (the weight sync's dtype) and quantizes that with the
trainer's recipe, so 1.5-3% of its e4m3 bytes would differ from the trainer's (the bf16
rounding in between moves some values across an e4m3 rounding boundary, and a row's amax
across a power of two). This forward casts the weight to the autocast dtype first, as
autocast does for ``F.linear`` and FSDP2's mixed precision does at its all-gather: the trainer
then quantizes the very bf16 tensor the rollout quantizes, into the same bytes and scales
(engine/fp8/weight_scales.py). Outside autocast, and under FSDP2 (which runs without
autocast, its weights gathered in bf16 already), it is torchao's forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args


class ComputeCopyFloat8Linear(Float8Linear):
    """Float8Linear whose weight, under autocast, is quantized from its autocast-dtype copy."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, device_type = self.weight, input.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            input = input.to(dtype)
            if type(weight) in (torch.Tensor, nn.Parameter):  # not one of torchao's float8 ones
                weight = weight.to(dtype)
        output = matmul_with_hp_or_float8_args.apply(
            input, weight.t(), self.linear_mm_config, self.config
        )
        return output if self.bias is None else output + self.bias.to(output.dtype)
