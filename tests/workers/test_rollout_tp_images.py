"""A colocated Qwen2.5-VL actor (tiny-vl, FSDP2 over 2 gloo ranks, fp32) into a
tensor-parallel rollout: every rank holds the vision encoder whole, a frozen one
(actor.freeze_vision_tower) copied once and left out of each sync, whose bytes are then the
block plan's (parallel/reshard_plan.py leaves the encoder out); a trained one moves whole
with every sync. The members' chunks of a generate batch carry their rows' images, and the
gathered rows sample, with their images, what one process with the trained model samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.data.image_batch import prompt_image_fields, prompt_images
from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.tensor_parallel import local_shard
from hybridflow.models import build_model
from hybridflow.models.mrope import mrope_positions
from hybridflow.models.presets import preset_config
from hybridflow.parallel.layout import build_mesh, rollout_layout, train_layout
from hybridflow.protocol import Batch
from hybridflow.workers.rollout_tp import TensorParallelRollout

CONFIG = preset_config("tiny-vl")
SPEC = CONFIG.vision
IMAGE, START, END = SPEC.image_token_id, SPEC.vision_start_token_id, SPEC.vision_end_token_id
WIDTH = 16
# per rank its chunk of two rows: an image of 4 x 6 patches and a text prompt; two images
PROMPTS = [[[5, START] + [IMAGE] * 6 + [END, 6, 7], [8, 9, 10]],
           [[11, START] + [IMAGE] * 4 + [END, 12, START] + [IMAGE] * 4 + [END], [13, 14]]]  # fmt: skip
GRIDS = [[torch.tensor([[1, 4, 6]]), None], [torch.tensor([[1, 4, 4], [1, 2, 8]]), None]]
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=4, ignore_eos=True)
OPTIONS = EngineOptions(kv_block_size=16, decode_backend="torch", cuda_graphs=False)


def _model(freeze: bool):
    """std-0.1 weights (std 0.05 in the encoder), the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(CONFIG, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator)
                    * (0.05 if name.startswith("visual.") else 0.1))  # fmt: skip
    if freeze:
        model.visual.requires_grad_(False)
    return model


def _shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    mesh = build_mesh(train_layout(2), "cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.submesh("fsdp"))
    fully_shard(model, mesh=mesh.submesh("fsdp"))


def _chunk(rank: int) -> Batch:
    """This rank's rows as the controller sends them: left-padded, with their images."""
    generator = torch.Generator().manual_seed(rank)
    prompts = torch.zeros(2, WIDTH, dtype=torch.long)
    mask = torch.zeros(2, WIDTH, dtype=torch.long)
    rows, pixels = [], []
    for i, (ids, grid) in enumerate(zip(PROMPTS[rank], GRIDS[rank])):
        prompts[i, WIDTH - len(ids) :] = torch.tensor(ids)
        mask[i, WIDTH - len(ids) :] = 1
        rows.append(torch.arange(len(ids)).expand(3, -1) if grid is None else
                    mrope_positions(torch.tensor(ids), grid, IMAGE, SPEC.spatial_merge_size))  # fmt: skip
        pixels.append(None if grid is None else torch.randn(
            int(grid.prod(-1).sum()), SPEC.patch_elements, generator=generator))  # fmt: skip
    tensors, arrays = prompt_image_fields(rows, pixels, GRIDS[rank], WIDTH)
    return Batch({"prompts": prompts, "attention_mask": mask, **tensors}, arrays, {"seed": 7})


def _train_step(model) -> None:
    """One SGD step on a next-token loss over an image prompt (every rank the same)."""
    chunk = _chunk(0)
    ids = chunk.tensors["prompts"][:1, WIDTH - len(PROMPTS[0][0]) :]
    pixels, grid = chunk.arrays["pixel_values"][0], chunk.arrays["image_grid_thw"][0]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=2.0)
    logits = model(ids[:, :-1], pixel_values=pixels, image_grid_thw=grid)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:])
    loss.backward()
    optimizer.step()


def _full(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _matches(tensor: TensorParallelRollout, full: dict[str, torch.Tensor]) -> None:
    rank = dist.get_rank()
    for name, value in tensor.model.named_parameters():
        expected = local_shard(name, full[name], rank, 2)
        assert torch.equal(value, expected), name
        if name.startswith("visual."):
            assert value.shape == full[name].shape, name


def _planned(stats) -> None:
    """The bytes moved are the block plan's, which leaves the vision encoder out."""
    from hybridflow.parallel.reshard_plan import reshard_traffic

    planned = reshard_traffic(CONFIG, train_layout(2), rollout_layout(2, tp=2), element_bytes=4)
    moved = torch.tensor([stats.bytes_sent])
    dist.all_reduce(moved)
    assert moved.item() == planned.total_moved > 0


def _on_ranks(rank: int, world: int, freeze: bool) -> None:
    model = _model(freeze)
    _shard(model)
    actor = SimpleNamespace(model=model)
    tensor = TensorParallelRollout.from_actor(actor, 2, torch.float32, "cpu", "tiny-vl")
    _matches(tensor, _full(model))
    synced = {entry.name for entry in tensor.resharder.parameters}
    assert ("visual.patch_embed.proj.weight" in synced) is not freeze
    before = _full(model)
    _train_step(model)
    after = _full(model)
    encoder = "visual.blocks.0.mlp.gate_proj.weight"
    assert torch.equal(before[encoder], after[encoder]) is freeze
    stats = tensor.sync(actor)
    if freeze:
        _planned(stats)
    _matches(tensor, after)
    # the group's chunks, each row with its images, sampled on the shared engine
    rows, chunk, chunk_rows = tensor.gather_rows(_chunk(rank))
    assert (chunk, chunk_rows, len(rows)) == (rank, 2, 4)
    ids = [row[m.bool()].tolist() for row, m in zip(rows.tensors["prompts"],
                                                    rows.tensors["attention_mask"])]  # fmt: skip
    assert ids == PROMPTS[0] + PROMPTS[1]
    images = prompt_images(rows)
    assert torch.equal(images[2].pixel_values, _chunk(1).arrays["pixel_values"][0])
    whole = build_model(CONFIG, seed=1).eval()
    whole.load_state_dict(after, strict=False)
    expected = Engine(whole, 8, 32, options=OPTIONS).generate(ids, SAMPLED, images=images)
    engine = Engine(tensor.model, 8, 32, options=OPTIONS)
    got = engine.generate(ids, SAMPLED, images=prompt_images(rows))
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen-encoder", "trained-encoder"])
def test_a_vision_language_actor_reshards_into_the_tensor_parallel_rollout(freeze):
    run_ranks(_on_ranks, 2, freeze)
