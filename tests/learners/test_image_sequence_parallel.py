"""Ulysses sequence parallelism (SP = 2, gloo, fp32) on a vision-language model (tiny-vl):
each rank runs the vision encoder on the micro-batch's whole images, takes the features of
the image tokens of its slice of the packed stream (an image straddles the two slices) and
its slice of mRoPE's three position rows, so the gathered log-probs equal one process's and
the ranks' gradients, summed, equal one process's, the encoder's included (trained); the
actor learner in that layout computes one process's log-probs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from learner_helpers import actor_config

from hybridflow.data.image_batch import MROPE_POSITIONS, extend_positions, prompt_image_fields
from hybridflow.learners import ActorLearner
from hybridflow.learners.modules import packed_hidden
from hybridflow.learners.response_forward import pack_batch_rows
from hybridflow.learners.sharding.sequence_shard import sliced_embeddings
from hybridflow.models import build_model
from hybridflow.models.mrope import mrope_positions
from hybridflow.models.presets import preset_config
from hybridflow.models.sharding.sequence_parallel import pad_positions, shard_stream
from hybridflow.protocol import Batch

CONFIG = preset_config("tiny-vl")
SPEC = CONFIG.vision
IMAGE, START, END = SPEC.image_token_id, SPEC.vision_start_token_id, SPEC.vision_end_token_id
# 10 + 12 + 9 = 31 tokens packed: each rank 16 (one pad token); the first image's tokens are
# stream tokens 12..17, 4 on rank 0 and 2 on rank 1
PROMPTS = [[7, 8, 9, 20, 21, 22, 23, 24], [5, START] + [IMAGE] * 6 + [END],
           [10, START] + [IMAGE] * 4 + [END, 6]]  # fmt: skip
GRIDS = [None, torch.tensor([[1, 4, 6]]), torch.tensor([[1, 4, 4]])]
RESPONSES = [[14, 15], [11, 12, 13], [16]]
CHECKED = ("visual.patch_embed.proj.weight", "visual.blocks.0.attn.qkv.weight",
           "visual.merger.mlp.0.weight", "model.embed_tokens.weight",
           "model.layers.0.self_attn.q_proj.weight")  # fmt: skip


def _batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    pixels = [None if g is None else torch.randn(int(g.prod()), SPEC.patch_elements,
                                                 generator=generator) for g in GRIDS]  # fmt: skip
    length_p, length_r = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    prompts = torch.zeros(len(PROMPTS), length_p, dtype=torch.long)
    responses = torch.zeros(len(PROMPTS), length_r, dtype=torch.long)
    mask = torch.zeros(len(PROMPTS), length_p + length_r, dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        prompts[i, length_p - len(prompt) :] = torch.tensor(prompt)
        responses[i, : len(response)] = torch.tensor(response)
        mask[i, length_p - len(prompt) : length_p + len(response)] = 1
    rows = [mrope_positions(torch.tensor(p), g, IMAGE, SPEC.spatial_merge_size) if g is not None
            else torch.arange(len(p)).expand(3, -1) for p, g in zip(PROMPTS, GRIDS)]  # fmt: skip
    tensors, arrays = prompt_image_fields(rows, pixels, GRIDS, length_p)
    response_mask = mask[:, length_p:].float()
    tensors[MROPE_POSITIONS] = extend_positions(tensors[MROPE_POSITIONS], response_mask)
    tensors.update(prompts=prompts, responses=responses, attention_mask=mask,
                   response_mask=response_mask)  # fmt: skip
    return Batch(tensors, arrays)


def _model():
    """std-0.1 weights (0.05 in the encoder), the same on every rank, all trained."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(CONFIG, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator)
                    * (0.05 if name.startswith("visual.") else 0.1))  # fmt: skip
    return model


def _logprobs(model, hidden, targets):
    return model.lm_head(hidden).log_softmax(-1).gather(-1, targets[:, None])[:, 0]


def test_a_slice_takes_the_features_of_its_own_image_tokens():
    """Without processes: the two slices' embeddings are the whole stream's, cut."""
    model, packed = _model().eval(), pack_batch_rows(_batch(), [0, 1, 2], "cpu")
    assert packed.position_ids.shape == (3, 31)
    whole = model.embed(packed.input_ids, packed.pixel_values, packed.image_grid_thw,
                        packed.prompt_tokens)  # fmt: skip
    slices = []
    for rank in range(2):
        shard = shard_stream(packed.cu_seqlens, packed.max_seqlen, rank, 2)
        slices.append(sliced_embeddings(model, packed.input_ids, shard, packed.pixel_values,
                                        packed.image_grid_thw, packed.prompt_tokens))  # fmt: skip
        rows = pad_positions(packed.position_ids, shard)  # [3, 16]: the pad token counts 0
        real = min(shard.stop, 31) - shard.start
        assert torch.equal(rows[:, :real], packed.position_ids[:, shard.start : shard.start + real])
        assert torch.equal(rows[:, real:], torch.zeros(3, 16 - real, dtype=rows.dtype))
    assert torch.equal(torch.cat(slices)[:31], whole)
    assert int((packed.input_ids[:16] == IMAGE).sum()) == 4  # the image straddles the cut


def _on_ranks(rank: int, world: int) -> None:
    group = dist.group.WORLD
    packed = pack_batch_rows(_batch(), [0, 1, 2], "cpu")
    single, sharded = _model(), _model()
    weights = torch.randn(packed.targets.shape[0], generator=torch.Generator().manual_seed(2))
    hidden, _ = packed_hidden(single, packed, None, {})
    expected = _logprobs(single, hidden, packed.targets)
    (expected * weights).sum().backward()
    local, outputs = packed_hidden(sharded, packed, group, {})
    got = outputs.gather(_logprobs(sharded, local, packed.targets[outputs.start : outputs.stop]))
    torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)
    (got * weights).sum().backward()  # each rank: the gradient of its own outputs
    params = dict(sharded.named_parameters())
    for name, p_single in single.named_parameters():
        if name not in CHECKED:
            continue
        grad = params[name].grad.clone()
        dist.all_reduce(grad, group=group)
        assert p_single.grad.abs().max() > 0, name
        torch.testing.assert_close(grad, p_single.grad, atol=1e-5, rtol=1e-4, msg=name)
    # the actor learner in SP = 2 (FSDP2 over the group), each rank handed its rows
    from hybridflow.parallel import build_mesh, train_layout

    mesh = build_mesh(train_layout(world, sp=2), "cpu")
    cfg = actor_config(ppo_mini_batch_size=2, freeze_vision_tower=False)
    one = ActorLearner(_model(), cfg, total_steps=1, device="cpu").compute_logprobs(_batch())
    actor = ActorLearner(_model(), cfg, total_steps=1, device="cpu", mesh=mesh)
    rows = [[0, 1], [2, 1]][rank]  # as the controller splits a batch (padded to divide)
    mine = actor.compute_logprobs(_batch().index(rows))["old_logprobs"]
    torch.testing.assert_close(mine, one["old_logprobs"][rows], atol=1e-5, rtol=1e-5)
    actor.update(_batch().index(rows).union(Batch({
        "advantages": torch.ones(2, 3), "old_logprobs": mine,
        "response_mask": _batch().index(rows)["response_mask"]})))  # fmt: skip


@pytest.mark.slow
def test_two_rank_ulysses_with_images_equals_one_process():
    run_ranks(_on_ranks, 2)
