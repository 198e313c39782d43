"""The mixture-of-experts kernels (kernels/experts/moe.py) against literal torch loops: the sort by
expert, the grouped expert matmuls and the combine (routing: test_routing.py). CUDA (marked gpu) or the CPU
under TRITON_INTERPRET=1, at tiny sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine.kernels.experts import moe, routing  # noqa: E402


def _expected_blocks(ids, experts, block_m, first=None):
    """The ExpertBlocks contract as a literal loop: each local expert's pairs in pair order,
    padded with P to a multiple of block_m; the expert of each block; each run's end."""
    flat = ids.flatten().tolist()
    pairs = len(flat)
    offset = first or 0
    expected, expected_blocks, expected_ends = [], [], []
    for expert in range(experts):
        run = [p for p, e in enumerate(flat) if e - offset == expert]  # pair order in a run
        padded = -(-len(run) // block_m) * block_m
        expected += run + [pairs] * (padded - len(run))
        expected_blocks += [expert] * (padded // block_m)
        expected_ends.append(len(expected))
    return expected, expected_blocks, expected_ends


def _assert_blocks(blocks, ids, experts, block_m, first=None):
    expected, expected_blocks, expected_ends = _expected_blocks(ids, experts, block_m, first)
    total = int(blocks.total)
    assert total == len(expected)
    assert blocks.sorted_pairs[:total].tolist() == expected
    assert blocks.block_expert[: total // block_m].tolist() == expected_blocks
    assert blocks.group_ends.tolist() == expected_ends
    assert blocks.max_blocks * block_m >= total
    assert blocks.sorted_pairs.shape[0] == blocks.max_blocks * block_m


def test_align_pairs_sorts_by_expert_in_pair_order_and_pads_runs():
    experts, block_m = 5, 16
    ids = torch.tensor([[0, 3], [3, 1], [4, 0], [0, 3], [1, 4], [3, 0], [0, 1], [3, 4], [0, 3]],
                       dtype=torch.int32, device=DEVICE)  # expert 2 untouched  # fmt: skip
    _assert_blocks(moe.align_pairs(ids, experts, block_m), ids, experts, block_m)


def _skewed_ids(tokens, top_k, experts, seed, unused=()):
    """top_k distinct experts a token, drawn with weights 1, 2, 4, ... (uneven runs: the last
    experts fill several blocks, the first ones one or none); `unused` experts never."""
    generator = torch.Generator().manual_seed(seed)
    weights = 2.0 ** torch.arange(experts, dtype=torch.float64).clamp(max=12)
    weights[list(unused)] = 0.0
    ids = torch.multinomial(weights.expand(tokens, experts), top_k, generator=generator)
    return ids.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m,unused",
    [
        (13, 3, 7, 16, (0, 4, 6)),  # P = 39, empty first/middle/last experts, E not 2^n
        (40, 4, 6, 32, (2,)),  # one expert several blocks long
        (1031, 4, 6, 16, (0,)),  # P = 4124: more than one chunk of pairs (the carried rank)
        (5, 1, 1, 16, ()),  # one expert
    ],
)
def test_align_pairs_places_uneven_runs_as_the_loop(tokens, top_k, experts, block_m, unused):
    ids = _skewed_ids(tokens, top_k, experts, seed=tokens, unused=unused)
    _assert_blocks(moe.align_pairs(ids, experts, block_m), ids, experts, block_m)


@pytest.mark.parametrize("counts,top_k", [((0, 1, 17, 0, 33, 2, 16, 0), 3), ((64, 1, 0), 5)])
def test_align_pairs_runs_of_given_lengths(counts, top_k):
    """Runs of 0, 1, a block, a block and one, several blocks (block_m 16), the pairs
    shuffled: each run holds exactly its pairs, in pair order."""
    generator = torch.Generator().manual_seed(len(counts))
    flat = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    flat = flat[torch.randperm(flat.numel(), generator=generator)]
    ids = flat.view(-1, top_k).to(torch.int32).to(DEVICE)
    blocks = moe.align_pairs(ids, len(counts), 16)
    _assert_blocks(blocks, ids, len(counts), 16)
    runs = torch.diff(blocks.group_ends.long(), prepend=blocks.group_ends.new_zeros(1).long())
    assert runs.tolist() == [-(-c // 16) * 16 for c in counts]


@pytest.mark.parametrize("first,share", [(0, 3), (3, 3), (2, 4)])
def test_align_pairs_of_a_share_places_only_its_experts(first, share):
    """first_expert: the local experts [first, first + share) of 8; the pairs of the other
    experts are in no run and counted in none (expert 3 of 8 gets no pair)."""
    ids = _skewed_ids(29, 3, 8, seed=first, unused=(3,))
    blocks = moe.align_pairs(ids, share, 16, first_expert=first)
    assert blocks.subset
    _assert_blocks(blocks, ids, share, 16, first)


def _reference_experts(x, ids, weights, gate_up, down):
    """The literal loop: each token's k experts, weighted and summed."""
    inner = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e] @ x[t]
            out[t] += weights[t, j] * (down[e] @ (F.silu(h[:inner]) * h[inner:]))
    return out


@pytest.mark.parametrize("tokens,block_m", [(7, 16), (40, 32)])
def test_grouped_expert_matmuls_and_combine_match_the_loop(tokens, block_m):
    """fp32; one expert gets more than a block (40 tokens x 3 over 6 experts), one none."""
    experts, top_k, hidden, inner = 6, 3, 48, 40  # inner not a multiple of the tile
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=generator) * 0.2).to(DEVICE)
    down = (torch.randn(experts, hidden, inner, generator=generator) * 0.2).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=generator).to(DEVICE)
    logits[:, 5] = -30.0  # expert 5 never chosen
    ids, weights = routing.route_topk(logits, top_k, renormalize=True)
    blocks = moe.align_pairs(ids, experts, block_m)
    act = moe.grouped_gate_up(x, gate_up, blocks)
    pair_out = moe.grouped_down(act, down, blocks)
    out = moe.combine(pair_out, weights)
    expected = _reference_experts(x, ids, weights, gate_up, down)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_block_rows_grows_with_the_pairs_per_expert():
    # Qwen3-30B-A3B (128 experts, top-8): 256 decode rows average 16 pairs an expert
    assert moe.block_rows(256, 8, 128) == 32
    assert moe.block_rows(16, 8, 128) == 16
    assert moe.block_rows(1024, 8, 128) == 64
    assert moe.block_rows(16384, 8, 128) == 128


@pytest.mark.parametrize("first", [0, 3])
def test_a_share_of_the_experts_skips_the_pairs_routed_elsewhere(first):
    """The weights hold experts [first, first + 3) of 6 (a rank's share in the tensor-parallel
    rollout): blocks name local experts, pairs of the other experts are in no block and add
    zero; the two shares sum to the whole layer. The torch path (models/moe.moe_experts with
    first_expert) is the reference."""
    from hybridflow.models.moe import moe_experts

    tokens, experts, top_k, hidden, inner, share = 9, 6, 2, 32, 24, 3
    generator = torch.Generator().manual_seed(first)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=generator) * 0.2).to(DEVICE)
    down = (torch.randn(experts, hidden, inner, generator=generator) * 0.2).to(DEVICE)
    ids, weights = routing.route_topk(torch.randn(tokens, experts, generator=generator).to(DEVICE),
                                      top_k, renormalize=True)  # fmt: skip
    mine = slice(first, first + share)
    blocks = moe.align_pairs(ids, share, 16, first_expert=first)
    local = ids.flatten() - first
    held = ((local >= 0) & (local < share)).sum().item()
    placed = blocks.sorted_pairs[: int(blocks.total)]
    assert (placed < tokens * top_k).sum().item() == held  # only the pairs of its experts
    assert blocks.block_expert[: int(blocks.total) // 16].max().item() < share
    pair_out = moe.grouped_down(moe.grouped_gate_up(x, gate_up[mine], blocks), down[mine], blocks)
    out = moe.combine(pair_out, weights)
    expected = moe_experts(x, ids.long(), weights, gate_up[mine], down[mine], "loop",
                           first_expert=first)  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    other = 3 - first
    rest = moe_experts(x, ids.long(), weights, gate_up[other : other + share],
                       down[other : other + share], "loop", first_expert=other)  # fmt: skip
    whole = _reference_experts(x, ids, weights, gate_up, down)
    torch.testing.assert_close(out + rest, whole, rtol=1e-5, atol=1e-5)


def _fused_layer_on_ranks(rank: int, world: int) -> None:
    import torch.distributed as dist

    from hybridflow.engine.layers.moe import experts_torch, experts_triton
    from hybridflow.engine.tensor_parallel import local_shard, tensor_parallel_model
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    whole = build_model(preset_config("tiny-moe"), seed=4).eval().requires_grad_(False)
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, torch.float32, "cpu")
    with torch.no_grad():
        params = dict(shard.named_parameters())
        for name, tensor in whole.named_parameters():
            params[name].copy_(local_shard(name, tensor, rank, world))
    x = torch.randn(5, whole.config.hidden_size, generator=torch.Generator().manual_seed(0))
    got = experts_triton(shard.model.layers[1].mlp, x, None, 0)  # 4 of 8 experts, all-reduced
    expected = experts_torch(whole.model.layers[1].mlp, x, None, 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU (the interpreter)")
def test_the_fused_sparse_layer_of_a_share_of_the_experts_sums_over_the_ranks():
    """engine/layers/moe.experts_triton on 2 gloo ranks, each holding 4 of tiny-moe's 8
    experts (engine/tensor_parallel.py): the all-reduced output is the whole layer's."""
    from gloo_ranks import run_ranks

    run_ranks(_fused_layer_on_ranks, 2)


@pytest.mark.parametrize("tokens,block_m,first", [(7, 16, None), (40, 32, None), (9, 16, 2)])
def test_fp8_expert_weights_match_the_loop_over_their_dequantized_weights(tokens, block_m,
                                                                          first):  # fmt: skip
    """The fp8 rollout's experts (weight-only): e4m3 gate_up/down with a scale per output row
    (fp8/experts.quantize_experts_into, the dense copies' quantize_weight), widened in the
    grouped kernels' inner loop and scaled in their epilogue, equal the fp32 loop over the
    dequantized weights values * scale; a share of the experts (first) skips the others."""
    from hybridflow.engine.fp8.experts import quantize_experts_into
    from hybridflow.models.moe import moe_experts

    experts, top_k, hidden, inner = 6, 3, 48, 40
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=generator) * 0.2).to(DEVICE)
    down = (torch.randn(experts, hidden, inner, generator=generator) * 0.2).to(DEVICE)
    gate_up[1, 3] *= 40.0  # an outlier row: its own scale, the other rows keep theirs
    ids, weights = routing.route_topk(torch.randn(tokens, experts, generator=generator).to(DEVICE),
                                      top_k, renormalize=True)  # fmt: skip
    share = slice(None) if first is None else slice(first, first + 3)
    gate_up, down = gate_up[share].contiguous(), down[share].contiguous()
    quantized = []
    for weight in (gate_up, down):
        values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
        scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=DEVICE)
        quantize_experts_into(weight, values, scale, chunk_elements=1)  # an expert at a time
        quantized.append((values, scale))
    (gate_up8, gate_up_scale), (down8, down_scale) = quantized
    blocks = moe.align_pairs(ids, gate_up.shape[0], block_m, first_expert=first)
    act = moe.grouped_gate_up(x, gate_up8, blocks, scale=gate_up_scale)
    out = moe.combine(moe.grouped_down(act, down8, blocks, scale=down_scale), weights)
    dequantized = [values.float() * scale[..., None] for values, scale in quantized]
    expected = moe_experts(x, ids.long(), weights, *dequantized, "loop", first_expert=first)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # and it is the quantization, not the kernel, that moves the output from the fp32 layer
    exact = moe_experts(x, ids.long(), weights, gate_up, down, "loop", first_expert=first)
    assert not torch.allclose(out, exact, rtol=1e-5, atol=1e-5)
    # (the outlier row's large activation meets down's rows' rounding: 17% at tokens=7)
    assert ((out - exact).norm() / exact.norm()).item() < 0.25
