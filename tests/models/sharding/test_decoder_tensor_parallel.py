"""Tensor parallelism of the decoder on 2 gloo ranks equals one process (fp32): the packed
forward, a loss over the logits and every parameter's gradient, for a qk-norm model (its norm
weight serves every head, each rank's heads add their share of its gradient) and the tiny
hybrid (Gated DeltaNet layers split by key heads with their value heads), on a stream of
several sequences; the split's divisibility check.

The hybrid's fp32 forward is itself only good to ~4e-5 on these logits (against fp64: the
chunked delta rule's triangular solves), and the split sums in another order, so it is
compared at that floor in fp32 and much closer in fp64 (where its norms and gates still
compute in fp32)."""

import pytest
import torch
import torch.nn.functional as F
from gloo_ranks import run_ranks
from model_helpers import randomized_model, small_config

from hybridflow.models.presets import PRESETS
from hybridflow.models.sharding.tensor_parallel import check_tensor_parallel

LENGTHS = [6, 9, 3, 1]
# name: (config, dtype, absolute tolerance of logits and gradients)
CONFIGS = {
    "qwen3 qk-norm": (small_config("qwen3", vocab_size=96), torch.float32, 1e-5),
    "tiny hybrid": (PRESETS["tiny-hybrid"], torch.float32, 1e-4),
    "tiny hybrid fp64": (PRESETS["tiny-hybrid"], torch.float64, 1e-6),
}


def _packed(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (sum(LENGTHS),), generator=g)
    targets = torch.randint(3, vocab, (sum(LENGTHS),), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return input_ids, targets, position_ids, cu_seqlens, max(LENGTHS)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _loss(model, input_ids, targets, position_ids, cu_seqlens, max_seqlen):
    hidden = model.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)
    logits = F.linear(hidden, _whole(model.lm_head.weight))  # vocabulary-split under TP
    return logits, F.cross_entropy(logits, targets)


def _check_tensor_parallel(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hybridflow.models.sharding.tensor_parallel import parallelize_decoder

    mesh = init_device_mesh("cpu", (world,))
    for name, (config, dtype, atol) in CONFIGS.items():
        single = randomized_model(config).to(dtype).train()
        split = randomized_model(config).to(dtype).train()
        batch = _packed(config.vocab_size)
        logits, loss = _loss(single, *batch)
        loss.backward()
        parallelize_decoder(split, mesh)
        split_logits, split_loss = _loss(split, *batch)
        split_loss.backward()
        torch.testing.assert_close(split_logits, logits, atol=atol, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name} logits: {m}")  # fmt: skip
        torch.testing.assert_close(split_loss, loss, atol=atol / 10, rtol=1e-6)
        params = dict(split.named_parameters())
        for param_name, param in single.named_parameters():
            torch.testing.assert_close(
                _whole(params[param_name].grad), param.grad, atol=atol, rtol=1e-4,
                msg=lambda m, where=f"{name}: {param_name}": f"{where}: {m}",
            )  # fmt: skip


@pytest.mark.slow
def test_two_rank_tensor_parallel_logits_loss_and_gradients_equal_one_process():
    run_ranks(_check_tensor_parallel, 2)


def test_tensor_parallel_needs_whole_gated_deltanet_key_heads():
    check_tensor_parallel(PRESETS["tiny-hybrid"], 2)
    with pytest.raises(ValueError, match="Gated DeltaNet key heads 2"):
        check_tensor_parallel(PRESETS["tiny-hybrid"], 4)
