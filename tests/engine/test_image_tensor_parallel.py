"""Prompts with images on the tensor-parallel engine (tiny-vl, fp32, 2 gloo processes): each
rank holds the vision encoder whole, encodes the same features and scatters them into its
shard of the language model, so both ranks draw the tokens one process with the whole model
draws (greedy and seeded sampling, images of two sizes), through Engine.generate and
through a lockstep service (a partial rollout's), whose other ranks' copies of a request
carry its images."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.images import PromptImages
from hybridflow.engine.serving.lockstep import LockstepService
from hybridflow.engine.tensor_parallel import local_shard, tensor_parallel_model
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.parallel.blocks import rollout_shard_dim, shard_dim

CONFIG = preset_config("tiny-vl")
SPEC = CONFIG.vision
IMAGE, START, END = SPEC.image_token_id, SPEC.vision_start_token_id, SPEC.vision_end_token_id
# an image of 4 x 6 patches (6 merged tokens), a text prompt, two images (4 + 4 tokens)
PROMPTS = [[5, START] + [IMAGE] * 6 + [END, 6, 7], [8, 9, 10],
           [11, START] + [IMAGE] * 4 + [END, 12, START] + [IMAGE] * 4 + [END]]  # fmt: skip
GRIDS = [torch.tensor([[1, 4, 6]]), None, torch.tensor([[1, 4, 4], [1, 2, 8]])]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=0.9, max_new_tokens=8, seed=3, ignore_eos=True)
EAGER = EngineOptions(decode_backend="torch", cuda_graphs=False, kv_block_size=16)


def test_the_vision_encoder_is_whole_on_every_rank():
    """Its MLP's projections share the decoder's names: told apart by their prefix."""
    for name in ("visual.blocks.0.mlp.gate_proj.weight", "visual.blocks.0.mlp.down_proj.weight",
                 "visual.blocks.0.attn.qkv.weight", "visual.merger.mlp.0.weight"):  # fmt: skip
        assert shard_dim(name) is None and rollout_shard_dim(name) is None, name
    full = torch.arange(64 * 32.0).view(64, 32)
    assert torch.equal(local_shard("visual.blocks.0.mlp.gate_proj.weight", full, 1, 2), full)
    assert shard_dim("model.layers.0.mlp.gate_proj.weight") == 0


def _model():
    """std-0.3 language-model weights (peaked logits), std-0.1 encoder weights (its features
    move the logits), the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(CONFIG, seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.1 if name.startswith("visual.") else 0.3, generator=generator)
    return model


def _images(flip: bool = False):
    generator = torch.Generator().manual_seed(0)
    images = []
    for grid in GRIDS:
        if grid is None:
            images.append(None)
            continue
        pixels = torch.randn(int(grid.prod(-1).sum()), SPEC.patch_elements, generator=generator)
        images.append(PromptImages(pixels.flip(0) if flip else pixels, grid))
    return images


def _tp_engine(whole) -> Engine:
    rank, size = dist.get_rank(), dist.get_world_size()
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, torch.float32, "cpu")
    engine = Engine(shard, 8, 64, options=EAGER)
    engine.load_weights((name, local_shard(name, tensor, rank, size).clone())
                        for name, tensor in whole.named_parameters(remove_duplicate=False))  # fmt: skip
    return engine


def _same(got, expected) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=1e-5)  # fmt: skip


def _generate_with_images(rank: int, world: int) -> None:
    whole = _model()
    alone = Engine(whole, 8, 64, options=EAGER)
    tp = _tp_engine(whole)
    assert tp.model.visual.blocks[0].mlp.gate_proj.weight.shape == (
        whole.visual.blocks[0].mlp.gate_proj.weight.shape)  # fmt: skip
    for params in (GREEDY, SAMPLED):
        expected = alone.generate(PROMPTS, params, images=_images())
        _same(tp.generate(PROMPTS, params, images=_images()), expected)
    # the images matter: other pixels, other tokens
    moved = tp.generate(PROMPTS, GREEDY, images=_images(flip=True))
    assert [c.token_ids for c in moved] != [c.token_ids for c in alone.generate(
        PROMPTS, GREEDY, images=_images())]  # fmt: skip


def test_tensor_parallel_engine_with_images_draws_the_tokens_of_one_process():
    run_ranks(_generate_with_images, 2)


def _lockstep_with_images(rank: int, world: int) -> None:
    whole = _model()
    first = [0, 2, 4]  # each prompt's first sample
    expected = Engine(whole, 8, 64, options=EAGER).generate(PROMPTS, SAMPLED, images=_images(),
                                                            sample_index=first)  # fmt: skip
    service = LockstepService(_tp_engine(whole), dist.new_group(backend="gloo"))
    if rank == 1:
        time.sleep(0.2)  # its request reaches the round at another moment than rank 0's
    mine = slice(rank * 2, rank * 2 + 2)  # rank 0: prompts 0 and 1, rank 1: prompt 2
    got = service.generate(PROMPTS[mine], SAMPLED, images=_images()[mine],
                           sample_index=first[mine])  # fmt: skip
    # a request of its own (an agent's turn): its images reach the other rank's copy too
    other = 2 - 2 * rank  # rank 0: the two-image prompt, rank 1: the one-image prompt
    handle = service.submit(PROMPTS[other], GREEDY, images=_images()[other])
    turn = handle.result(timeout=60)
    service.close()
    expected_rows = [c for i, c in enumerate(expected) if mine.start * 2 <= i < mine.stop * 2]
    _same(got, expected_rows)
    alone = Engine(whole, 8, 64, options=EAGER)
    _same(turn, alone.generate([PROMPTS[other]], GREEDY, images=[_images()[other]]))


def test_lockstep_service_carries_a_requests_images_to_the_other_ranks():
    run_ranks(_lockstep_with_images, 2)
