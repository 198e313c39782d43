"""The tensor-parallel engine on the triton backend, 2 gloo processes under TRITON_INTERPRET=1
(tiny preset with an o_proj bias, fp32 CPU): each rank runs the split decode layer's fused
kernels over its heads and MLP columns, o_proj's and down_proj's partial products summed over
the group, and both ranks draw the tokens one process with the whole model draws on the same
backend, greedy and sampled; a mixture of experts' split experts likewise, with its routes.
With fp8 weights: each rank's e4m3 copies and scales are the slices of the one-process
engine's (every recipe), the tokens are the one-process fp8 engine's where both quantize the
activations with the same scales, and with each row's own scales (a rank's columns: the
engine's choice, engine/fp8/matmul.py) the log-probs are a rounding apart. Each rank computes
half of the one-process references (interpreted Triton is slow) and the ranks exchange them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.backend import resolve_backend
from hybridflow.engine.tensor_parallel import local_shard, tensor_parallel_model
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

pytest.importorskip("triton")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernels on CPU need TRITON_INTERPRET=1")  # fmt: skip

PROMPTS = [[5, 17, 9, 33], [40, 41]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=7, ignore_eos=True)
SINGLE = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)


def test_auto_picks_triton_on_a_gpu_whatever_the_tensor_parallel_size():
    """The backend depends on neither tensor nor expert parallelism (experts spread over
    replicas decode on the fused layers too: test_expert_spread_fused.py)."""
    from hybridflow.engine import backend

    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    if backend._triton_available():
        assert resolve_backend("auto", torch.device("cuda")) == "triton"


def _model():
    """The tiny preset with an o_proj bias (added once, after the sum), the same on every
    rank: std-0.3 projections and a std-1 embedding (the tied head), so the logits are peaked
    (greedy log-probs near -0.1): no near ties for fp32 rounding to flip."""
    config = dataclasses.replace(preset_config("tiny"), o_proj_bias=True)
    generator = torch.Generator().manual_seed(1)
    model = build_model(config, seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            std = 0.1 if name.endswith("bias") else 1.0 if "embed" in name else 0.3
            p.normal_(0, std, generator=generator)
    return model


def _shard(whole):
    rank, size = dist.get_rank(), dist.get_world_size()
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, torch.float32, "cpu")
    with torch.no_grad():
        for name, param in shard.named_parameters():
            param.copy_(local_shard(name, whole.get_parameter(name), rank, size))
    return shard


def _options(weight_format: str) -> EngineOptions:
    # cuBLAS-side matmuls (torch on the CPU): the interpreter runs the row-wise kernels only
    return EngineOptions(decode_backend="triton", weight_format=weight_format, kv_block_size=16,
                         decode_matmul="cublas")  # fmt: skip


def _references(whole, weight_format: str) -> list:
    """The one-process engine's completions for GREEDY and SAMPLED: rank r runs the r-th."""
    engine = Engine(whole, max_batch_size=4, max_seq_len=32, options=_options(weight_format))
    mine = engine.generate(PROMPTS, (GREEDY, SAMPLED)[dist.get_rank()])
    both = [None, None]
    dist.all_gather_object(both, [(c.token_ids, c.logprobs) for c in mine])
    return both


def _check(tp, references, tolerance: float) -> None:
    for params, expected in zip((GREEDY, SAMPLED), references):
        got = tp.generate(PROMPTS, params)
        assert [c.token_ids for c in got] == [tokens for tokens, _ in expected]
        for completion, (_, logprobs) in zip(got, expected):
            torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(logprobs),
                                       rtol=tolerance, atol=tolerance)  # fmt: skip


def _model_dtype_on_ranks(rank: int, world: int) -> None:
    whole = _model()
    references = _references(whole, "model")
    tp = Engine(_shard(whole), max_batch_size=4, max_seq_len=32, options=_options("model"))
    assert tp.tensor_parallel == 2 and tp.decode_backend == "triton"
    _check(tp, references, 1e-4)
    assert tp.chooser.layer == "split" and tp.fused.gate_up_weight is not None


@interpreted
@pytest.mark.slow
def test_two_ranks_on_the_fused_layers_draw_the_tokens_of_one_process():
    run_ranks(_model_dtype_on_ranks, 2)


def _rows_of_rank(copy: torch.Tensor, sizes: list[int], interleaved: bool) -> torch.Tensor:
    """This rank's rows of a whole model's fused copy [N, ...] made of parts of ``sizes`` rows
    (each part's rows split evenly; gate/up pairs interleaved)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if interleaved:
        return copy.unflatten(0, (-1, 2)).chunk(size)[rank].flatten(0, 1)
    return torch.cat([part.chunk(size)[rank] for part in copy.split(sizes)])


def _check_copies_are_slices(whole_fp8, shard_fp8, whole, shard) -> None:
    """Each e4m3 copy and its scales on this rank: the one-process copy's rows (q/k/v and
    gate/up) or columns with the whole rows' scales (o_proj, down_proj)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    fused = whole_fp8.fused
    sizes = [fused.q_size, fused.kv_size, fused.kv_size]
    for index, (full, part) in enumerate(zip(whole.model.layers, shard.model.layers)):
        pairs = [(fused.qkv_weight[index], shard_fp8.fused.qkv_weight[index], "qkv"),
                 (fused.gate_up_weight[index], shard_fp8.fused.gate_up_weight[index], "gate_up"),
                 (full.self_attn.o_proj.weight, part.self_attn.o_proj.weight, "columns"),
                 (full.mlp.down_proj.weight, part.mlp.down_proj.weight, "columns")]  # fmt: skip
        for full_weight, part_weight, split in pairs:
            _, want8, want_scale = whole_fp8.copies[full_weight.data_ptr()]
            _, got8, got_scale = shard_fp8.copies[part_weight.data_ptr()]
            if split == "columns":
                want8 = want8.chunk(size, dim=1)[rank]
            else:
                want8 = _rows_of_rank(want8, sizes, split == "gate_up")
                want_scale = _rows_of_rank(want_scale.t(), sizes, split == "gate_up").t()
            assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8)), (index, split)
            assert torch.equal(got_scale, want_scale), (index, split)


@contextlib.contextmanager
def _row_blind_activation_scales():
    """Every fp8 activation quantized with one fixed scale (amax 16), in place of each row's
    own: a row-parallel input's scale then no longer depends on which of its columns a rank
    holds, so what remains between the ranks and one process is the sums' order."""
    from hybridflow.engine.fp8 import matmul
    from hybridflow.engine.fp8.e4m3 import quantize_rows_by_amax
    from hybridflow.engine.kernels import rowwise

    def fixed(x):
        return quantize_rows_by_amax(x, torch.full((x.shape[0], 1), 16.0, device=x.device))

    with mock.patch.multiple(
        rowwise,
        rms_norm_e4m3=lambda x, norm, weighted=True, launch=None: fixed(
            rowwise.rms_norm(x, norm, weighted)),
        add_rms_norm_e4m3=lambda residual, delta, norm, weighted=True, launch=None: fixed(
            rowwise.add_rms_norm(residual, delta, norm, weighted)),
        silu_mul_pairs_e4m3=lambda product, launch=None: fixed(rowwise.silu_mul_pairs(product)),
    ), mock.patch.object(matmul, "quantize_rows", fixed):  # fmt: skip
        yield


def _fp8_on_ranks(rank: int, world: int) -> None:
    from hybridflow.engine.fp8.matmul import Fp8Matmul
    from hybridflow.engine.weights.fused import FusedProjections

    whole = _model()
    shard = _shard(whole)
    for recipe in ("rowwise", "tensorwise"):  # the trainer's: the fused copies hold the weights
        copies = [Fp8Matmul(m, FusedProjections(m, gate_up=True, fold=False), weight_scales=recipe)
                  for m in (whole, shard)]  # fmt: skip
        _check_copies_are_slices(*copies, whole, shard)
    tp = Engine(shard, max_batch_size=4, max_seq_len=32, options=_options("fp8"))
    with _row_blind_activation_scales():
        _check(tp, _references(whole, "fp8"), 1e-4)
    one = Engine(whole, max_batch_size=4, max_seq_len=32, options=_options("fp8"))
    one.num_slots  # the fp8 copies are made with the cache  # noqa: B018
    _check_copies_are_slices(one.fp8, tp.fp8, whole, shard)  # the engine's own scales, folded
    # each row's own scales: o_proj's and down_proj's inputs quantized over a rank's columns,
    # a rounding apart from one process's (the first token's log-prob: the prefill's)
    for got, want in zip(tp.generate(PROMPTS, SINGLE), one.generate(PROMPTS, SINGLE)):
        assert abs(got.logprobs[0] - want.logprobs[0]) < 0.25


@interpreted
@pytest.mark.slow
def test_two_ranks_with_fp8_weights_quantize_slices_of_one_process_and_draw_its_tokens():
    """The tokens are one process's where the activation scales are the same on both sides;
    with each row's own, the log-probs are a rounding apart."""
    run_ranks(_fp8_on_ranks, 2)


def _moe_on_ranks(rank: int, world: int) -> None:
    """tiny-moe cut to its dense first layer and one sparse layer, std-0.3 weights: each rank
    holds 4 of the 8 experts and experts_triton sums the partial outputs over the group.
    Greedy only, rank 0 running the one-process reference (the interpreted expert kernels are
    slow)."""
    config = dataclasses.replace(preset_config("tiny-moe"), num_hidden_layers=2)
    generator = torch.Generator().manual_seed(2)
    whole = build_model(config, seed=2).eval().requires_grad_(False)
    for name, p in whole.named_parameters():
        if not name.endswith("norm.weight"):
            p.normal_(0, 0.3, generator=generator)
    tp = Engine(_shard(whole), max_batch_size=4, max_seq_len=32, options=_options("model"))
    assert tp.decode_backend == "triton"
    assert tp.model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 4
    got = tp.generate(PROMPTS, GREEDY)
    expected = [None]
    if rank == 0:
        one = Engine(whole, max_batch_size=4, max_seq_len=32, options=_options("model"))
        expected = [[(c.token_ids, c.logprobs, c.routed_experts.tolist())
                     for c in one.generate(PROMPTS, GREEDY)]]  # fmt: skip
    dist.broadcast_object_list(expected, src=0)
    assert [c.token_ids for c in got] == [tokens for tokens, _, _ in expected[0]]
    for completion, (_, logprobs, routes) in zip(got, expected[0]):
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(logprobs),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        assert completion.routed_experts.tolist() == routes


@interpreted
@pytest.mark.slow
def test_two_ranks_of_a_mixture_of_experts_on_the_fused_layers_draw_the_tokens_of_one_process():
    run_ranks(_moe_on_ranks, 2)
