"""A colocated actor's weights into a tensor-parallel rollout of Qwen3.5's layers (2 gloo
ranks, fp32): tiny-hybrid trained FSDP2 over both ranks or tensor-parallel over them
(models/sharding/tensor_parallel.py: in_proj_qkv's and the conv's rows an even split, not
whole heads), and its Qwen3.5-MoE variant trained FSDP2, take an optimizer step (the
tensor-parallel one new values in its shards); each sync
reshards the trainer's shards straight into the engine's (engine/reshard.py): each rank
gets exactly its key heads' rows of in_proj_qkv and the conv taps (a piece of each [q; k; v]
section), of in_proj_z/a/b, its A_log and dt_bias, its columns of out_proj, its gated-
attention heads with their gates, the norms whole. The engine then draws the tokens one
process with the trained model draws; the bytes moved are the block plan's. Split placement
reads each rank's heads from a checkpoint directory, Qwen3-Next's fused projections too; LoRA
adapters arrive merged into each rank's pieces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.tensor_parallel import local_shard
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.parallel.blocks import deltanet_sections
from hybridflow.parallel.layout import build_mesh, rollout_layout, train_layout
from hybridflow.workers.rollout_tp import TensorParallelRollout, training_sources


def _config(moe: bool):
    config = preset_config("tiny-hybrid")
    if moe:  # Qwen3.5-MoE's layers: routed experts and a gated shared expert
        config = config.replace(model_type="qwen3_5_moe_text", num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=True)  # fmt: skip
    return config


def _model(config):
    """std-0.1 weights, the same on every rank (logits small enough for 1e-5 in fp32)."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(config, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _shard(model, train) -> None:
    """Tensor parallelism where the layout has it, then FSDP2 over its fsdp ranks."""
    from torch.distributed.fsdp import fully_shard

    from hybridflow.models.sharding.tensor_parallel import parallelize_decoder

    mesh = build_mesh(train, "cpu")
    if train.tp > 1:
        parallelize_decoder(model, mesh.submesh("tp"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.submesh("fsdp"))
    fully_shard(model, mesh=mesh.submesh("fsdp"))


def _train_step(model) -> None:
    """One SGD step on a next-token loss (every rank the same batch)."""
    ids = torch.tensor([[5, 17, 9, 33, 2, 71, 40, 41, 12, 100]])
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:])
    loss.backward()
    optimizer.step()


def _update_in_place(model) -> None:
    """What a tensor-parallel trainer's step does to the reshard: new values in its shards,
    elementwise (its logits come from the vocab-parallel log-probs, not the model's
    forward: models/sharding/vocab_parallel.py)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * p.sin())


def _full(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _matches(tensor: TensorParallelRollout, full: dict[str, torch.Tensor]) -> None:
    rank, sections = dist.get_rank(), deltanet_sections(tensor.architecture)
    state = dict(tensor.model.named_parameters())
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in state
    for name, value in state.items():
        assert torch.equal(value, local_shard(name, full[name], rank, 2, sections=sections)), name


def _same_tokens(engine_model, full: dict[str, torch.Tensor], config) -> None:
    whole = build_model(config, seed=1).eval()
    whole.load_state_dict(full, strict=False)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4, ignore_eos=True)
    options = EngineOptions(kv_block_size=16, decode_backend="torch")
    prompts = [[5, 17, 9, 33, 2, 71, 8, 9, 10], [40, 41, 42, 43]]
    expected = Engine(whole, 8, 32, options=options).generate(prompts, params)
    got = Engine(engine_model, 8, 32, options=options).generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=1e-5)  # fmt: skip


def _planned(stats, config, train) -> None:
    """The bytes moved are the block plan's (parallel/reshard_plan.py, the memory plan's
    reshard line)."""
    from hybridflow.parallel.reshard_plan import reshard_traffic

    planned = reshard_traffic(config, train, rollout_layout(2, tp=2), element_bytes=4)
    most = torch.tensor([stats.bytes_received, stats.bytes_sent])
    moved = torch.tensor([stats.bytes_sent])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    dist.all_reduce(moved)
    assert most.tolist() == [planned.received, planned.sent] and planned.received > 0
    assert moved.item() == planned.total_moved


def _reshard_on_ranks(rank: int, world: int, moe: bool, train_tp: int) -> None:
    config, train = _config(moe), train_layout(2, tp=train_tp)
    model = _model(config)
    _shard(model, train)
    actor = SimpleNamespace(model=model)
    tensor = TensorParallelRollout.from_actor(actor, 2, torch.float32, "cpu", "tiny-hybrid")
    before = _full(model)
    _matches(tensor, before)
    if train_tp == 1:
        _train_step(model)
    else:
        _update_in_place(model)
    after = _full(model)
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert not torch.equal(before[qkv], after[qkv])
    stats = tensor.sync(actor)
    _planned(stats, config, train)
    _matches(tensor, after)
    _same_tokens(tensor.model, after, config)


@pytest.mark.parametrize(
    ("moe", "train_tp"), [(False, 1), (False, 2), (True, 1)],
    ids=["tiny-hybrid-fsdp", "tiny-hybrid-tensor-parallel", "tiny-hybrid-moe-fsdp"],
)  # fmt: skip
def test_a_trained_actor_reshards_into_the_tensor_parallel_rollout(moe, train_tp):
    run_ranks(_reshard_on_ranks, 2, moe, train_tp)


def _load_on_ranks(rank: int, world: int, path: str, moe: bool) -> None:
    config = _next_config() if moe else _config(moe=False)
    whole = dict(build_model(config, seed=5).named_parameters())
    tensor = TensorParallelRollout.from_checkpoint(path, 2, torch.float32, "cpu")
    sections = deltanet_sections(config)
    for name, param in tensor.model.named_parameters():
        assert torch.equal(param, local_shard(name, whole[name], rank, 2, sections=sections)), name


def _next_config():
    """Qwen3-Next's layout of the same layers: its checkpoint fuses each key head's q, k, v
    and z rows into in_proj_qkvz (and a and b into in_proj_ba), split on reading."""
    return _config(moe=True).replace(model_type="qwen3_next")


@pytest.mark.parametrize("moe", [False, True], ids=["tiny-hybrid", "qwen3-next-layout"])
def test_split_placement_reads_each_ranks_heads_from_a_checkpoint(tmp_path, moe):
    build_model(_next_config() if moe else _config(moe=False), seed=5).save_pretrained(
        str(tmp_path))  # fmt: skip
    run_ranks(_load_on_ranks, 2, str(tmp_path), moe)


def _lora_on_ranks(rank: int, world: int) -> None:
    """LoRA on q/k/v and o_proj (Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj),
    FSDP2 over both ranks: each rank's pieces of in_proj_qkv arrive merged, W + scale · B @ A,
    as learners/lora merges the whole weight."""
    from hybridflow.learners.lora import apply_lora, lora_scalings, merge_lora_stream

    model = _model(_config(moe=False))
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with torch.no_grad():  # lora_B starts at 0: give the adapters something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    merged = dict(merge_lora_stream(model.state_dict().items(), lora_scalings(model)))
    _shard(model, train_layout(2))
    actor = SimpleNamespace(model=model)
    tensor = TensorParallelRollout.from_actor(actor, 2, torch.float32, "cpu", "tiny-hybrid")
    _, adapters = training_sources(model, dict(tensor.model.named_parameters()))
    assert {"model.layers.0.linear_attn.in_proj_qkv.weight",
            "model.layers.3.self_attn.q_proj.weight"} <= set(adapters)  # fmt: skip
    sections = deltanet_sections(tensor.architecture)
    for name, param in tensor.model.named_parameters():
        expected = local_shard(name, merged[name], rank, 2, sections=sections)
        torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-6, msg=name)


def test_lora_adapters_merge_into_each_ranks_heads():
    run_ranks(_lora_on_ranks, 2)


def _spread_reshard_on_ranks(rank: int, world: int) -> None:
    """Qwen3.5-MoE trained FSDP2 over 4 ranks into 2 tensor-parallel rollout replicas with
    the experts over all 4 (rollout tp 2, ep 4: engine/expert_spread.py): each rank gets its
    replica's heads (in_proj_qkv and the conv taps by key heads) and its own experts."""
    from hybridflow.engine.expert_spread import spread_shard

    config = _config(moe=True)
    model = _model(config)
    _shard(model, train_layout(world))
    actor = SimpleNamespace(model=model)
    tensor = TensorParallelRollout.from_actor(actor, 2, torch.float32, "cpu", "tiny-hybrid",
                                              expert_parallel_size=world)  # fmt: skip
    assert tensor.spread
    sections = deltanet_sections(config)
    _train_step(model)
    tensor.sync(actor)
    full = _full(model)
    for name, value in tensor.model.named_parameters():
        want = spread_shard(name, full[name], rank, world, rank % 2, 2, sections)
        assert torch.equal(value, want), name
    experts = tensor.model.model.layers[0].mlp.experts.gate_up_proj
    assert experts.shape[0] == config.num_experts // world


@pytest.mark.slow
def test_a_trained_actor_reshards_into_tensor_parallel_replicas_with_spread_experts():
    run_ranks(_spread_reshard_on_ranks, 4)
