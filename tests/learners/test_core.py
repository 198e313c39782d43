"""TrainCore's mixed precision on one device: the residual stream runs in bf16 under the
core's autocast, and the same module called outside it (the SFT warm start's greedy accuracy
check, an evaluation) still computes in fp32, as its fp32 weights need.

The CPU stands in for CUDA: mixed_precision=True takes the same unsharded path."""

from __future__ import annotations

import torch
from learner_helpers import tiny_model

from hybridflow.learners.core import TrainCore
from hybridflow.learners.modules import PolicyModel

IDS = torch.tensor([[5, 17, 9, 33, 2, 71]])


def embedding_output_dtypes(core: TrainCore) -> list[torch.dtype]:
    """Calls the language model once under the core's autocast and once outside it; the
    dtype the embedding handed to the first layer each time."""
    seen = []
    handle = core.module.lm.model.layers[0].register_forward_pre_hook(
        lambda _module, args: seen.append(args[0].dtype)
    )
    with torch.no_grad():
        with core.autocast():
            core.module.lm(IDS)
        logits = core.module.lm(IDS)
    handle.remove()
    assert logits.dtype == torch.float32
    return seen


def test_the_residual_stream_is_bf16_under_autocast_and_fp32_outside_it():
    core = TrainCore(PolicyModel(tiny_model()), device="cpu", mixed_precision=True)
    assert core.compute_dtype == torch.bfloat16
    assert embedding_output_dtypes(core) == [torch.bfloat16, torch.float32]


def test_without_mixed_precision_the_stream_stays_fp32_everywhere():
    core = TrainCore(PolicyModel(tiny_model()), device="cpu", mixed_precision=False)
    assert embedding_output_dtypes(core) == [torch.float32, torch.float32]
