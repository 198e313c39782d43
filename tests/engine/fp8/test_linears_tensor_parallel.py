"""The fp8 rollout's eager passes (engine/fp8/linears.py) on a tensor-parallel shard, 2 gloo
processes (fp32 CPU), against one process with the whole model: Qwen3.5-MoE (gated attention,
Gated DeltaNet, a gated shared expert, 2 of 4 routed experts a rank), DeepSeek-V3 (MLA, a
dense MLP, shared experts, 4 of 8 grouped-routed experts a rank, or all 8 on every rank) and
GPT-OSS (sink attention
with an o_proj bias; its biased experts stay in the model's dtype).

Each rank's e4m3 copies and scales are the slices of the one-process fp8 engine's: a
column-parallel projection its rows, a row-parallel one (o_proj, out_proj, down_proj) its
columns with the whole rows' scales; routed experts whole. What a rank computes apart from one
process is the rounding of a row-parallel projection's input, quantized per row over the
rank's own columns. So the reference is the whole model in fp32 over the copies' weights
widened back, each projection's input rounded per row as a rank rounds it (test_linears'
emulated model, the row-parallel inputs rounded per rank's columns): greedy tokens equal,
log-probs within test_linears' 1e-4 (the sums' order), and the first token's within its 0.3
of the one-process fp8 engine. A weight sync (each rank's slices copied into its shard, as the
reshard does) re-quantizes on both ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from test_linears import (
    FP8,
    GREEDY,
    MODEL_DTYPE,
    PROMPTS,
    _assert_same,
    _config,
    _emulated_model,
    _flip_outputs,
    _generate,
    _model,
    _names,
)

from hybridflow.engine import Engine
from hybridflow.engine.tensor_parallel import local_shard, tensor_parallel_model
from hybridflow.models import build_model
from hybridflow.parallel.blocks import deltanet_sections, rollout_shard_dim

PRESETS = ["tiny-hybrid-moe", "tiny-deepseek-v3", "tiny-gpt-oss"]


def _whole(preset: str):
    """test_linears' model; Qwen3.5-MoE's shared expert 64 wide (32 columns a rank: both
    dims of an fp8 weight multiples of 16 on a rank too)."""
    if preset != "tiny-hybrid-moe":
        return _model(preset)
    config = _config(preset).replace(shared_expert_intermediate_size=64)
    generator = torch.Generator().manual_seed(3)
    model = build_model(config, seed=3).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _state(model):
    """Parameters and saved buffers (DeepSeek's score correction), HF names."""
    saved = set(model.state_dict())
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    return [(name, tensor) for name, tensor in named if name in saved]


def _sync(engine, whole, split_experts: bool) -> None:
    """A weight sync: this rank's slice of each parameter copied into the shard in place."""
    rank, size = dist.get_rank(), dist.get_world_size()
    sections = deltanet_sections(whole.config)
    engine.load_weights((name, local_shard(name, tensor, rank, size, split_experts, sections))
                        for name, tensor in _state(whole))  # fmt: skip


def _reference(whole, one):
    """The whole model over one's copies, the row-parallel projections' inputs (the weights
    whose columns the ranks split) rounded per rank's columns, as the ranks round them."""
    split = {name: dist.get_world_size() for name, module in whole.named_modules()
             if hasattr(module, "weight") and rollout_shard_dim(f"{name}.weight") == 1}  # fmt: skip
    return _emulated_model(whole, one, split)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """e4m3 values as their bytes (torch.equal compares those), any other tensor as it is."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def _assert_copies_are_slices(one, tp, whole, split_experts: bool) -> None:
    """Each rank copy: the one-process copy's rows (column-parallel) or columns with the whole
    rows' scales (row-parallel); routed experts: the rank's experts (all of them, unsplit)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    sections = deltanet_sections(whole.config)
    shard_names = _names(tp.model)
    assert shard_names == _names(whole)  # every projection one process quantizes
    whole_copies = {w.data_ptr(): (w8, s) for w, w8, s in one.fp8.copies.values()}
    shard_copies = {w.data_ptr(): (w8, s) for w, w8, s in tp.fp8.copies.values()}
    for name, module in whole.model.layers.named_modules():
        if name.split(".", 1)[-1] not in shard_names:
            continue
        full = f"model.layers.{name}.weight"
        want8, want_scale = whole_copies[module.weight.data_ptr()]
        got8, got_scale = shard_copies[tp.model.get_parameter(full).data_ptr()]
        want8 = local_shard(full, want8.view(torch.uint8), rank, size, sections=sections)
        if rollout_shard_dim(full) == 0:  # its rows, each with its own scale
            want_scale = local_shard(full, want_scale.t(), rank, size, sections=sections).t()
        assert torch.equal(got8.view(torch.uint8), want8), full
        assert torch.equal(got_scale, want_scale), full
    for index, copies in tp.fp8.experts.layers.items():
        whole_copies = one.fp8.experts.layers[index]
        share = whole_copies.gate_up.shape[0] // (size if split_experts else 1)
        first = rank * share if split_experts else 0
        for got, want in zip(copies, whole_copies):  # values and scales, gate_up and down
            assert torch.equal(_bits(got), _bits(want[first : first + share]))


def _compare_on_ranks(rank: int, world: int, preset: str, split_experts: bool) -> None:
    whole = _whole(preset)
    one, one_fp8 = _generate(whole, FP8)
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, torch.float32, "cpu",
                                  split_experts)  # fmt: skip
    tp = Engine(shard, 4, 64, options=FP8)
    _sync(tp, whole, split_experts)
    got = tp.generate(PROMPTS, GREEDY)
    _assert_copies_are_slices(one, tp, whole, split_experts)
    assert bool(tp.fp8.experts.layers) == (preset != "tiny-gpt-oss")
    _, expected = _generate(_reference(whole, one), MODEL_DTYPE)
    _assert_same(got, expected, atol=1e-4)
    # near one process's fp8 engine: the first token (the prompt alone, the same context)
    # a rounding of the row-parallel inputs apart; the later tokens may part, the rounding
    # tipping near ties of these tiny models' flat logits
    for a, b in zip(got, one_fp8):
        assert abs(a.logprobs[0] - b.logprobs[0]) < 0.3

    _flip_outputs(whole)  # a training step, resharded into both ranks
    one.weights_updated()
    _generate(one)  # its copies re-quantized, the reference's weights
    _sync(tp, whole, split_experts)
    synced = tp.generate(PROMPTS, GREEDY)
    _assert_copies_are_slices(one, tp, whole, split_experts)
    assert [a.logprobs for a in synced] != [a.logprobs for a in got]
    _assert_same(synced, _generate(_reference(whole, one), MODEL_DTYPE)[1], atol=1e-4)
    gathered = [None] * world
    dist.all_gather_object(gathered, [c.token_ids for c in synced])
    assert all(tokens == gathered[0] for tokens in gathered)


@pytest.mark.parametrize(("preset", "split_experts"),
                         [*((preset, True) for preset in PRESETS), ("tiny-deepseek-v3", False)])  # fmt: skip
def test_two_ranks_compute_their_slices_of_one_process_copies_and_a_sync_requantizes(
    preset, split_experts
):
    """split_experts=False (rollout.expert_parallel_size=1): every rank holds every expert
    and runs a sparse layer whole, from copies equal to one process's."""
    run_ranks(_compare_on_ranks, 2, preset, split_experts)
