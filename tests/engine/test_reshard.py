"""The training-to-rollout reshard on gloo processes, into a tensor-parallel engine of
rollout TP = 2, bucket by bucket: from FSDP2 shards (2 and 4 ranks), from a tensor-parallel
actor with FSDP2 on top (4 ranks: DP 2 × TP 2), from a LoRA actor (adapters merged as they
move), from a mixture of experts (each rank receives only its own experts; also from an
expert-parallel actor whose experts FSDP2 shards over 2 ranks each), and from an
actor in the rollout's own layout (TP 2 over the same 2 ranks), where nothing moves. Every engine parameter equals its slice of the full (merged) model, the bytes
moved are what the pure plan (parallel/reshard_plan.py) says, no bucket's buffers pass the
bucket size, and the engine then draws the tokens of one process with the whole model."""

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
from hybridflow.workers.rollout_tp import training_sources

BUCKET_BYTES = 48 * 2**10  # several buckets; on 4 ranks one gate_proj alone moves 48 KiB


def _shard(model, train):
    """FSDP2 over the layout's fsdp ranks, on top of its tensor parallelism (as the learner
    does, learners/core.py)."""
    from torch.distributed.fsdp import fully_shard

    from hybridflow.models.sharding.tensor_parallel import parallelize_decoder

    mesh = build_mesh(train, "cpu")
    if train.tp > 1:
        parallelize_decoder(model, mesh.submesh("tp"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.submesh("fsdp"))
    fully_shard(model, mesh=mesh.submesh("fsdp"))


def _engine_model(rollout, preset: str = "tiny"):
    group = build_mesh(rollout, "cpu").group("tp")
    return tensor_parallel_model(preset_config(preset), group, torch.float32, "cpu")


def _resharder(model, engine_model, rollout):
    targets = dict(engine_model.named_parameters())
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    blocks = {name: rollout_blocks(name, shapes[name], rollout)[dist.get_rank()]
              for name in targets}  # fmt: skip
    return Resharder(dict(model.named_parameters()), targets, blocks, bucket_bytes=BUCKET_BYTES)


def _check_traffic(stats, train, rollout, targets, preset: str = "tiny",
                   bucket_bytes: int = BUCKET_BYTES) -> None:  # fmt: skip
    planned = reshard_traffic(preset_config(preset), train, rollout, element_bytes=4)
    assert stats.buckets >= 2 and 0 < stats.peak_buffer_bytes <= bucket_bytes, stats
    mine = torch.tensor([stats.bytes_received, stats.bytes_sent, stats.bytes_kept])
    most, least, moved = mine.clone(), mine.clone(), mine[1:2].clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    dist.all_reduce(moved)
    assert most[:2].tolist() == [planned.received, planned.sent]
    assert (least[2].item(), moved.item()) == (planned.kept, planned.total_moved)
    # no rank holds the whole model: half of every layer, less than a full gather moved
    assert sum(p.numel() * 4 for p in targets.values()) == planned.rollout_shard
    assert stats.bytes_received < planned.gathered


def _same_tokens(engine_model, whole) -> None:
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=4, ignore_eos=True)
    options = EngineOptions(kv_block_size=16)
    prompts = [[5, 17, 9], [40, 41, 42, 43]]
    expected = Engine(whole, 8, 32, options=options).generate(prompts, params)
    got = Engine(engine_model, 8, 32, options=options).generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]


def _from_fsdp(world: int, train_tp: int) -> None:
    train, rollout = train_layout(world, tp=train_tp), rollout_layout(world, tp=2)
    model = build_model(preset_config("tiny"), seed=3)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    _shard(model, train)
    engine_model = _engine_model(rollout)
    resharder = _resharder(model, engine_model, rollout)
    stats = resharder.run(dict(model.named_parameters()))
    targets = dict(engine_model.named_parameters())
    tp_rank = dist.get_rank() % 2
    for name, param in targets.items():
        assert torch.equal(param, local_shard(name, full[name], tp_rank, 2)), name
    _check_traffic(stats, train, rollout, targets)
    # values changed in place (an optimizer step) move on the next run
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().add_(1.0)
    resharder.run(dict(model.named_parameters()))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(targets[name], local_shard(name, full[name] + 1.0, tp_rank, 2))
    whole = build_model(preset_config("tiny"), seed=3)
    with torch.no_grad():
        for param in whole.parameters():
            param.add_(1.0)
    _same_tokens(engine_model, whole)


def _from_fsdp_experts() -> None:
    """tiny-moe, FSDP2 over 2 ranks into rollout TP 2 with the experts split: each rank
    receives its 4 experts of 8 (packed [E, ...] tensors cut by whole experts; FSDP2's dim-0
    chunks already hold them, so they never move), the router and norms whole, the bytes the
    plan says, and samples the tokens of the whole model."""
    train, rollout = train_layout(2), rollout_layout(2, tp=2)
    model = build_model(preset_config("tiny-moe"), seed=3)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    _shard(model, train)
    engine_model = _engine_model(rollout, "tiny-moe")
    stats = _resharder(model, engine_model, rollout).run(dict(model.named_parameters()))
    targets = dict(engine_model.named_parameters())
    for name, param in targets.items():
        assert torch.equal(param, local_shard(name, full[name], dist.get_rank(), 2)), name
    experts = targets["model.layers.1.mlp.experts.down_proj"]
    assert experts.shape[0] == 4  # no rank holds every expert
    # the dense layer's down_proj alone moves 2 × 48 KiB: a bucket of its own
    _check_traffic(stats, train, rollout, targets, "tiny-moe", 2 * BUCKET_BYTES)
    _same_tokens(engine_model, build_model(preset_config("tiny-moe"), seed=3))


def _from_expert_shards(world: int) -> None:
    """tiny-moe trained expert-parallel (EP = 2 over 4 ranks: each expert on the 2 ranks of
    its expert_fsdp group, FSDP2-sharded over them, learners/sharding/expert_shard.py) into rollout
    TP 2 with the experts split: the 2-D expert shards reshard like any block."""
    from torch.distributed.fsdp import fully_shard

    from hybridflow.learners.sharding.expert_shard import distribute_experts, shard_experts

    train, rollout = train_layout(world, ep=2), rollout_layout(world, tp=2)
    model = build_model(preset_config("tiny-moe"), seed=3)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    mesh = build_mesh(train, "cpu")
    experts = distribute_experts(model, mesh)
    options = {"mesh": mesh.submesh("fsdp")}
    if not shard_experts(model, mesh, options):
        options["ignored_params"] = set(experts)
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    engine_model = _engine_model(rollout, "tiny-moe")
    _resharder(model, engine_model, rollout).run(dict(model.named_parameters()))
    tp_rank = dist.get_rank() % 2
    for name, param in engine_model.named_parameters():
        assert torch.equal(param, local_shard(name, full[name], tp_rank, 2)), name


def _from_lora() -> None:
    """An FSDP2-sharded LoRA model: W + scale · B @ A arrives, as learners/lora merges it."""
    from hybridflow.learners.lora import apply_lora, lora_scalings, merge_lora_stream

    rollout = rollout_layout(2, tp=2)
    model = build_model(preset_config("tiny"), seed=3)
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "o_proj", "down_proj"])
    with torch.no_grad():  # lora_B starts at 0: give the adapters something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    merged = dict(merge_lora_stream(model.state_dict().items(), lora_scalings(model)))
    _shard(model, train_layout(2))
    engine_model = _engine_model(rollout)
    targets = dict(engine_model.named_parameters())
    shapes = {name: tuple(t.shape) for name, t in merged.items()}
    blocks = {name: rollout_blocks(name, shapes[name], rollout)[dist.get_rank()]
              for name in targets}  # fmt: skip
    sources, adapters = training_sources(model, targets)
    assert set(adapters) == {f"model.layers.{i}.{m}.weight" for i in range(2)
                             for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")}  # fmt: skip
    Resharder(sources, targets, blocks).run(*training_sources(model, targets))
    for name, param in targets.items():
        expected = local_shard(name, merged[name], dist.get_rank(), 2)
        torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-6, msg=name)


def _from_expert_lora(spread: bool) -> None:
    """tiny-moe with LoRA on its experts (per-expert factors, models/moe.ExpertLoRA) and the
    attention, FSDP2 over 2 ranks, into rollout TP 2 with the experts split, or into 2
    replicas of one rank with the experts spread over both (engine/expert_spread.py): each
    rank's experts arrive merged, W_e + scale · B_e @ A_e, as learners/lora merges them."""
    from hybridflow.engine.expert_spread import expert_parallel_model, spread_shard
    from hybridflow.learners.lora import apply_lora, lora_scalings, merge_lora_stream

    rank = dist.get_rank()
    model = build_model(preset_config("tiny-moe"), seed=3)
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "experts"])
    with torch.no_grad():  # B starts at 0: give the adapters something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name or name.endswith("_B"):
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    merged = dict(merge_lora_stream(model.state_dict().items(), lora_scalings(model)))
    _shard(model, train_layout(2))
    if spread:
        rollout = rollout_layout(2, tp=1, ep=2)
        group = build_mesh(rollout, "cpu").group("ep")
        engine_model = expert_parallel_model(preset_config("tiny-moe"), group, None,
                                             torch.float32, "cpu")  # fmt: skip
    else:
        rollout = rollout_layout(2, tp=2)
        engine_model = _engine_model(rollout, "tiny-moe")
    targets = dict(engine_model.named_parameters())
    blocks = {name: rollout_blocks(name, tuple(merged[name].shape), rollout)[rank]
              for name in targets}  # fmt: skip
    sources, adapters = training_sources(model, targets)
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
            "model.layers.0.self_attn.q_proj.weight"} <= set(adapters)  # fmt: skip
    Resharder(sources, targets, blocks).run(sources, adapters)
    for name, param in targets.items():
        expected = (spread_shard(name, merged[name], rank, 2) if spread
                    else local_shard(name, merged[name], rank, 2))  # fmt: skip
        torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-6, msg=name)
    assert targets["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 4


def _expert_lora_on_ranks(rank: int, world: int) -> None:
    _from_expert_lora(spread=False)
    _from_expert_lora(spread=True)


def test_expert_adapters_merge_as_they_reshard():
    run_ranks(_expert_lora_on_ranks, 2)


def _same_layout() -> None:
    """Actor TP 2 over both ranks (FSDP2 over one) into rollout TP 2: the layouts coincide,
    every rank copies its own blocks and nothing crosses ranks (no collective runs)."""
    train, rollout = train_layout(2, tp=2), rollout_layout(2, tp=2)
    model = build_model(preset_config("tiny"), seed=3)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    _shard(model, train)
    engine_model = _engine_model(rollout)
    resharder = _resharder(model, engine_model, rollout)
    calls = []
    all_to_all = dist.all_to_all_single
    dist.all_to_all_single = lambda *args, **kwargs: calls.append(args)  # must not be called
    try:
        stats = resharder.run(dict(model.named_parameters()))
    finally:
        dist.all_to_all_single = all_to_all
    targets = dict(engine_model.named_parameters())
    for name, param in targets.items():
        assert torch.equal(param, local_shard(name, full[name], dist.get_rank(), 2)), name
    assert calls == [] and stats.bytes_received == stats.bytes_sent == stats.peak_buffer_bytes == 0
    assert stats.bytes_kept == sum(p.numel() * 4 for p in targets.values())
    planned = reshard_traffic(preset_config("tiny"), train, rollout, element_bytes=4)
    assert planned.total_moved == 0 and planned.kept == stats.bytes_kept


def _reshard_on_ranks(rank: int, world: int) -> None:
    _from_fsdp(world, train_tp=1)
    if world == 4:
        _from_fsdp(world, train_tp=2)
        _from_expert_shards(world)
    else:
        _from_lora()
        _same_layout()
        _from_fsdp_experts()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_training_shards_reshard_into_a_tensor_parallel_engine(world):
    run_ranks(_reshard_on_ranks, world)
