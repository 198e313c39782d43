"""Block arithmetic and the reshard's plan by hand: FSDP2's chunks, who sends what to whom,
and the bytes one sync of the tiny preset moves (the memory plan's numbers)."""

import pytest
import torch

from hybridflow.models.llama import CausalLM
from hybridflow.models.presets import preset_config
from hybridflow.parallel.blocks import (
    Transfer,
    chunk_range,
    fsdp_block,
    intersect,
    tensor_parallel_block,
    transfer_plan,
)
from hybridflow.parallel.layout import rollout_layout, train_layout
from hybridflow.parallel.reshard_plan import (
    parameter_shapes,
    reshard_traffic,
    rollout_blocks,
    training_blocks,
)


def test_fsdp_chunks_are_torch_chunk_sizes_with_empty_tails():
    # torch.chunk(10 rows, 4): ceil(10 / 4) = 3 rows each, the last one 1
    assert [chunk_range(10, i, 4) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # 2 rows over 4 ranks: ranks 2 and 3 hold nothing
    assert [fsdp_block(((0, 2),), i, 4) for i in range(4)] == [((0, 1),), ((1, 2),), None, None]
    for rows, parts in ((10, 4), (7, 3), (2, 4), (64, 2)):
        sizes = [t.shape[0] for t in torch.empty(rows).chunk(parts)]
        ours = [stop - start for start, stop in (chunk_range(rows, i, parts) for i in range(parts))]
        assert ours[: len(sizes)] == sizes and sum(ours) == rows


def test_a_row_parallel_weight_moves_the_off_diagonal_quarters():
    # a [4, 6] o_proj: FSDP2 rows 0-1 / 2-3, rollout TP columns 0-2 / 3-5 (dim 1)
    sources = [fsdp_block(((0, 4), (0, 6)), rank, 2) for rank in range(2)]
    dests = [tensor_parallel_block((4, 6), 1, rank, 2) for rank in range(2)]
    assert transfer_plan(sources, dests) == [
        Transfer(0, 0, ((0, 2), (0, 3))),  # kept: rank 0's rows of its columns
        Transfer(1, 0, ((2, 4), (0, 3))),
        Transfer(0, 1, ((0, 2), (3, 6))),
        Transfer(1, 1, ((2, 4), (3, 6))),
    ]


def test_replicas_send_their_share_and_a_holder_keeps_its_own():
    # ranks 0 and 1 hold rows 0-1, ranks 2 and 3 rows 2-3 (replicated twice); everyone
    # wants all 4 rows: each copies its own half and reads the other from holder dest % 2
    sources = [((0, 2),), ((0, 2),), ((2, 4),), ((2, 4),)]
    plan = transfer_plan(sources, [((0, 4),)] * 4)
    assert [(t.source, t.dest) for t in plan] == [
        (0, 0), (2, 0), (1, 1), (3, 1), (0, 2), (2, 2), (1, 3), (3, 3)]  # fmt: skip
    with pytest.raises(ValueError, match="covered by 2 of its 4"):
        transfer_plan([((0, 2),), None], [((0, 4),), ((0, 4),)])
    assert intersect(((0, 2), (0, 2)), ((2, 4), (0, 2))) is None


def test_parameter_shapes_are_the_models():
    for preset in ("tiny", "tiny-4l", "qwen2.5-0.5b", "llama3-8b", "tiny-moe"):
        arch = preset_config(preset)
        with torch.device("meta"):
            model = CausalLM(arch)
        assert parameter_shapes(arch) == [(name, tuple(p.shape))
                                          for name, p in model.named_parameters()]  # fmt: skip


def test_a_vision_language_models_shapes_are_its_decoders():
    # the encoder is left out of the sync's traffic (frozen by default); building the model
    # without it once failed the family's check and took `config plan` down with it
    arch = preset_config("tiny-vl")
    shapes = dict(parameter_shapes(arch))
    assert shapes and not any(name.startswith("visual.") for name in shapes)
    assert (
        "model.embed_tokens.weight" in shapes and "model.layers.0.self_attn.q_proj.weight" in shapes
    )
    traffic = reshard_traffic(arch, train_layout(2), rollout_layout(2, tp=2), element_bytes=2)
    assert traffic.received > 0


def test_the_rollout_splits_the_experts_by_whole_experts():
    """tiny-moe (3 sparse layers of 8 experts, width 128, hidden 128): split over rollout TP 2,
    a rank holds 4 experts of each packed tensor, so its shard is smaller by half the experts:
    3 layers × 4 experts × (256 × 128 + 128 × 128) elements × 4 bytes = 1.5 MiB."""
    arch = preset_config("tiny-moe")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert rollout_blocks(name, (8, 256, 128), rollout_layout(2, tp=2)) == [
        ((0, 4), (0, 256), (0, 128)), ((4, 8), (0, 256), (0, 128))]  # fmt: skip
    assert rollout_blocks(name, (8, 256, 128), rollout_layout(2, tp=2), split_experts=False) == [
        ((0, 8), (0, 256), (0, 128))] * 2  # fmt: skip
    train, rollout = train_layout(2), rollout_layout(2, tp=2)
    split = reshard_traffic(arch, train, rollout, element_bytes=4)
    whole = reshard_traffic(arch, train, rollout, element_bytes=4, split_experts=False)
    assert whole.rollout_shard - split.rollout_shard == 3 * 4 * (256 + 128) * 128 * 4
    # FSDP2's dim-0 chunks over 2 ranks hold experts [0, 4) and [4, 8): nothing of them moves
    assert whole.received - split.received == 3 * 4 * (256 + 128) * 128 * 4


def test_training_tensor_parallel_then_fsdp_on_the_shard():
    # 4 ranks, tp=2: FSDP2 over dp = 2 cuts each TP shard of a [8, 4] q_proj in two
    layout = train_layout(4, tp=2)
    assert training_blocks("model.layers.0.self_attn.q_proj.weight", (8, 4), layout) == [
        ((0, 2), (0, 4)), ((4, 6), (0, 4)), ((2, 4), (0, 4)), ((6, 8), (0, 4))]  # fmt: skip
    # a row-parallel down_proj [4, 8]: columns by TP, rows by FSDP2
    assert training_blocks("model.layers.0.mlp.down_proj.weight", (4, 8), layout)[3] == (
        (2, 4), (4, 8))  # fmt: skip


def test_one_sync_of_the_tiny_preset_by_hand():
    """2 ranks, FSDP2 over both, rollout TP = 2, fp32. tiny: H 64, 4 heads and 2 KV heads of
    16 (q 64 rows, k/v 32), MLP 192, vocabulary 128 (tied), 2 layers, q/k/v biases."""
    traffic = reshard_traffic(preset_config("tiny"), train_layout(2), rollout_layout(2, tp=2),
                              element_bytes=4)  # fmt: skip
    # q/k/v, their biases, gate/up and the embedding: FSDP2's rows are the TP rows: kept.
    # Per layer a rank receives: 2 norms x 32 + o_proj's other 32 rows of its 32 columns
    # (1024) + down_proj's other 32 rows of its 96 columns (3072) = 4160; x 2 layers, + 32
    # of the final norm = 8352 elements = 33,408 bytes; the same sent.
    assert (traffic.received, traffic.sent, traffic.total_moved) == (33408, 33408, 66816)
    # a rank's rollout shard: embedding 64x64 = 4096; per layer norms 128, q 32x64 + 32,
    # k and v 16x64 + 16 each, o 64x32, gate and up 96x64, down 64x96 = 24768; x 2 + 64
    # = 53,696 elements = 214,784 bytes, of which 53,696 - 8,352 = 45,344 kept = 181,376
    assert (traffic.rollout_shard, traffic.kept) == (214784, 181376)
    # gathering whole tensors instead: the other half of all 107,072 parameters = 214,144
    assert traffic.gathered == 214144


def test_llama_70b_fsdp_on_8_gpus_into_rollout_tp_8_moves_the_row_parallel_weights():
    """FSDP2 over 8 GPUs -> rollout TP 8, bf16. q/k/v, gate/up and the vocabulary: FSDP2's
    row chunk r is TP shard r, kept. o_proj [8192, 8192] and down_proj [8192, 28672]: a GPU
    holds 1/8 of the rows and needs 1/8 of the columns: it receives 7/64 of each; the norms
    (whole in the rollout) 7/8. Per layer 7/64 x 8192 x (8192 + 28672) + 2 x 7/8 x 8192 =
    33,044,480 elements; x 80 layers + 7/8 of the final norm (7,168) = 2,643,565,568
    elements = 5,287,131,136 bytes (4.92 GiB), against 115 GiB gathering whole tensors."""
    traffic = reshard_traffic(preset_config("llama3.1-70b"), train_layout(8),
                              rollout_layout(8, tp=8))  # fmt: skip
    assert traffic.received == traffic.sent == 5_287_131_136
    # the same layout in training and rollout (actor TP 8): every block stays where it is
    same = reshard_traffic(preset_config("llama3.1-70b"), train_layout(8, tp=8),
                           rollout_layout(8, tp=8))  # fmt: skip
    assert same.received == 0 and same.kept == same.rollout_shard
