"""A colocated actor's weights into a tensor-parallel rollout of GPT-OSS and DeepSeek-V3 (2
gloo ranks, fp32): the actor is FSDP2-sharded over both ranks, takes an optimizer step, and
each sync reshards its shards straight into the engine's (engine/reshard.py): GPT-OSS's
sinks and q/k/v biases split with their heads, o_proj's bias whole; MLA's q_b_proj and
kv_b_proj rows split with their heads, the latent projection and its norm whole; the
experts (with GPT-OSS's biases) split by whole experts, DeepSeek's shared experts like a
dense MLP and its router's score correction (a buffer) copied whole. Every engine
parameter equals its slice of the trained model, and the engine then draws the tokens one
process with the trained model draws; the bytes moved are the block plan's."""

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
from hybridflow.workers.rollout_tp import TensorParallelRollout


def _model(preset: str):
    """std-0.3 weights, sinks and biases: peaked logits, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config(preset), seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    return model


def _shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _train_step(model) -> None:
    """One SGD step on a next-token loss (every rank the same batch)."""
    ids = torch.tensor([[5, 17, 9, 33, 2, 71, 40, 41, 12, 100]])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:])
    loss.backward()
    optimizer.step()


def _full(model) -> dict[str, torch.Tensor]:
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    full.update({name: b.clone() for name, b in model.named_buffers()})
    return full


def _matches(tensor: TensorParallelRollout, full: dict[str, torch.Tensor]) -> None:
    rank = dist.get_rank()
    state = {**tensor.persistent_buffers(), **dict(tensor.model.named_parameters())}
    assert "model.layers.1.mlp.experts.down_proj" in state
    for name, value in state.items():
        assert torch.equal(value, local_shard(name, full[name], rank, 2)), name


def _same_tokens(engine_model, full: dict[str, torch.Tensor], preset: str) -> None:
    whole = build_model(preset_config(preset), seed=1).eval()
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


def _planned(stats, preset: str) -> None:
    """The bytes moved are the block plan's (parallel/reshard_plan.py, the memory plan's
    reshard line), read off the model's own parameters."""
    from hybridflow.parallel.layout import rollout_layout, train_layout
    from hybridflow.parallel.reshard_plan import reshard_traffic

    planned = reshard_traffic(preset_config(preset), train_layout(2), rollout_layout(2, tp=2),
                              element_bytes=4)  # fmt: skip
    most = torch.tensor([stats.bytes_received, stats.bytes_sent])
    moved = torch.tensor([stats.bytes_sent])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    dist.all_reduce(moved)
    assert most.tolist() == [planned.received, planned.sent] and planned.received > 0
    assert moved.item() == planned.total_moved


def _reshard_on_ranks(rank: int, world: int, preset: str) -> None:
    model = _model(preset)
    _shard(model)
    actor = SimpleNamespace(model=model)
    tensor = TensorParallelRollout.from_actor(actor, 2, torch.float32, "cpu", preset)
    before = _full(model)
    _matches(tensor, before)
    _train_step(model)
    after = _full(model)
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert any("sinks" in name or "kv_b_proj" in name for name in moved)
    stats = tensor.sync(actor)
    _planned(stats, preset)
    _matches(tensor, after)
    _same_tokens(tensor.model, after, preset)


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-deepseek-v3"])
def test_a_trained_actor_reshards_into_the_tensor_parallel_rollout(preset):
    run_ranks(_reshard_on_ranks, 2, preset)
