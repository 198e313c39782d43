"""The training-to-rollout reshard on gloo processes: an FSDP2-sharded model (2 and 4 ranks)
into a tensor-parallel engine of rollout TP = 2, bucket by bucket. Every engine parameter
equals its slice of the full model, the bytes moved are what the pure plan
(parallel/reshard_plan.py) says, no bucket's buffers pass the bucket size, and the engine
then draws the tokens of one process with the whole model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.reshard import Resharder
from hybridflow.engine.tensor_parallel import local_shard, tensor_parallel_model
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.parallel.layout import build_mesh, rollout_layout, train_layout
from hybridflow.parallel.reshard_plan import reshard_traffic, rollout_blocks

BUCKET_BYTES = 48 * 2**10  # several buckets; on 4 ranks one gate_proj alone moves 48 KiB


def _sharded_model():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(preset_config("tiny"), seed=3)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, full


def _reshard_on_ranks(rank: int, world: int) -> None:
    model, full = _sharded_model()
    train, rollout = train_layout(world), rollout_layout(world, tp=2)
    tp_group = build_mesh(rollout, "cpu").group("tp")
    engine_model = tensor_parallel_model(model.config, tp_group, torch.float32, "cpu")
    targets = dict(engine_model.named_parameters())
    blocks = {name: rollout_blocks(name, tuple(full[name].shape), rollout)[rank]
              for name in targets}  # fmt: skip
    sources = dict(model.named_parameters())
    resharder = Resharder(sources, targets, blocks, bucket_bytes=BUCKET_BYTES)
    stats = resharder.run(sources)
    tp_rank = rank % 2
    for name, param in targets.items():
        assert torch.equal(param, local_shard(name, full[name], tp_rank, 2)), name
    assert stats.buckets >= 2 and 0 < stats.peak_buffer_bytes <= BUCKET_BYTES, stats
    # the numbers of the pure plan: the largest over ranks, per rank in total
    planned = reshard_traffic(model.config, train, rollout, element_bytes=4)
    mine = torch.tensor([stats.bytes_received, stats.bytes_sent, stats.bytes_kept])
    most, least = mine.clone(), mine.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    assert most[:2].tolist() == [planned.received, planned.sent]
    assert least[2].item() == planned.kept
    moved = torch.tensor([stats.bytes_sent])
    dist.all_reduce(moved)
    assert moved.item() == planned.total_moved
    # no rank holds the whole model: half of every layer, and less than one full gather
    engine_bytes = sum(p.numel() * 4 for p in targets.values())
    assert engine_bytes == planned.rollout_shard
    assert stats.bytes_received < planned.gathered
    # values changed in place (an optimizer step) move on the next run
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().add_(1.0)
    resharder.run(dict(model.named_parameters()))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(targets[name], local_shard(name, full[name] + 1.0, tp_rank, 2))
    # and the engine samples as one process with the whole model does
    whole = build_model(preset_config("tiny"), seed=3)
    with torch.no_grad():
        for param in whole.parameters():
            param.add_(1.0)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=4, ignore_eos=True)
    options = EngineOptions(kv_block_size=16)
    prompts = [[5, 17, 9], [40, 41, 42, 43]]
    expected = Engine(whole, 8, 32, options=options).generate(prompts, params)
    got = Engine(engine_model, 8, 32, options=options).generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_shards_reshard_into_a_tensor_parallel_engine(world):
    run_ranks(_reshard_on_ranks, world)
