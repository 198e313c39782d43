"""Expert parallelism on 2 gloo processes (EP = 2, 4 of the tiny MoE's 8 experts each) gives
one process's forward, losses, router losses, gradients and AdamW step on the same tokens,
with the router's own routes and with replayed ones."""

import os

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import leave_group, start_ranks

from hybridflow.learners.router_terms import router_terms
from hybridflow.models import load_model
from hybridflow.models.moe import NO_ROUTE
from hybridflow.models.sharding.expert_parallel import (
    keep_local_experts,
    local_expert_of_received,
    local_expert_range,
)

LENGTHS = [5, 7, 6, 4]  # rank r gets sequences 2r and 2r+1
HIDDEN, SPARSE_LAYERS, TOP_K, EXPERTS = 128, 3, 2, 8
LR = 1e-2
AUX, Z = 0.1, 0.01  # large enough that the router terms move the gradients visibly


def test_received_rows_are_labelled_by_source_then_expert():
    # rank 0 sent 2 rows to local expert 0 and 1 to expert 1; rank 1 sent 0 and 3
    counts = torch.tensor([[2, 1], [0, 3]])
    assert local_expert_of_received(counts).tolist() == [0, 0, 1, 1, 1, 1]


def test_local_expert_range_splits_in_blocks():
    assert [local_expert_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="8 experts do not split over 3"):
        local_expert_range(8, 0, 3)


def _data():
    generator = torch.Generator().manual_seed(5)
    total = sum(LENGTHS)
    input_ids = torch.randint(0, 128, (total,), generator=generator)
    # replayed routes: k distinct experts per token; each sequence's first token routes freely
    routes = torch.rand(total, SPARSE_LAYERS, EXPERTS, generator=generator).argsort(-1)
    routes = routes[..., :TOP_K].clone()
    starts = torch.tensor([0, *LENGTHS]).cumsum(0)[:-1]
    routes[starts] = NO_ROUTE
    projection = torch.randn(total, HIDDEN, generator=generator)
    return input_ids, routes, projection


def _run(sequences: list[int], group, replay: bool, share: float):
    """Forward + backward of the sequences' tokens; returns (hidden, local loss, router
    terms, model)."""
    input_ids, routes, projection = _data()
    starts = torch.tensor([0, *LENGTHS]).cumsum(0)
    take = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in sequences])
    lengths = [LENGTHS[s] for s in sequences]
    model = load_model("tiny-moe")
    if group is not None:
        keep_local_experts(model, group)
    trace = []
    hidden = model.forward_packed(
        input_ids[take],
        torch.cat([torch.arange(n) for n in lengths]),
        torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
        max(lengths),
        routed_experts=routes[take] if replay else None,
        router_trace=trace,
    )  # [N, H]
    task_loss = (hidden * projection[take]).sum()
    router_loss, terms, _ = router_terms(
        trace, EXPERTS, aux_loss_coef=AUX, z_loss_coef=Z, share=share, expert_group=group
    )
    (task_loss + router_loss).backward()
    return hidden.detach(), task_loss.detach(), terms, model


def _adamw(model) -> torch.optim.AdamW:
    # Adam's first step is lr * g / (|g| + eps): with the default eps (1e-8) an entry whose
    # gradient is ~1e-7 (float noise of the summation order, 1e-8 of the largest) moves by
    # 2% of lr between the two runs; eps = 1e-3 keeps the step a smooth function of g.
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-3)


def _gathered_update(model, group) -> tuple[dict, dict]:
    """Full gradients (dense ones summed over the ranks, experts concatenated), then the
    full weights after one AdamW step on them."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        if ".experts." in name:
            parts = [torch.empty_like(param.grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, param.grad, group=group)
            grads[name] = torch.cat(parts)
        else:
            dist.all_reduce(param.grad, group=group)
            grads[name] = param.grad.clone()
    _adamw(model).step()
    weights = {}
    for name, param in model.named_parameters():
        if ".experts." in name:
            parts = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, param.detach(), group=group)
            weights[name] = torch.cat(parts)
        else:
            weights[name] = param.detach().clone()
    return grads, weights


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        results = {}
        own = [2 * rank, 2 * rank + 1]
        share = sum(LENGTHS[s] for s in own) / sum(LENGTHS)
        for replay in (False, True):
            hidden, task_loss, terms, model = _run(own, group, replay, share)
            assert model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == EXPERTS // world
            hiddens = [None] * world
            dist.all_gather_object(hiddens, hidden)
            losses = torch.stack([task_loss, terms["moe/aux_loss"], terms["moe/z_loss"]])
            dist.all_reduce(losses)  # the task loss and the 1/EP router terms add up
            grads, weights = _gathered_update(model, group)
            results[replay] = dict(hidden=torch.cat(hiddens), losses=losses, grads=grads,
                                   weights=weights)  # fmt: skip
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "ep.pt"))
        dist.barrier()
    finally:
        leave_group()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def test_two_ep_ranks_equal_one_process(tmp_path):
    start_ranks(_worker, 2, str(tmp_path))
    results = torch.load(tmp_path / "ep.pt", weights_only=True)
    for replay in (False, True):
        ep = results[replay]
        hidden, task_loss, terms, model = _run([0, 1, 2, 3], None, replay, share=1.0)
        losses = torch.stack([task_loss, terms["moe/aux_loss"], terms["moe/z_loss"]])
        assert _relative(ep["hidden"], hidden) < 1e-5
        assert _relative(ep["losses"], losses) < 1e-5, (ep["losses"], losses)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert sorted(ep["grads"]) == sorted(grads)
        for name, grad in grads.items():
            assert _relative(ep["grads"][name], grad) < 1e-5, name
        _adamw(model).step()
        for name, param in model.named_parameters():
            # the step (of size ~lr) agrees to 1% of its size
            assert (ep["weights"][name] - param.detach()).abs().max() < 1e-2 * LR, name


FAMILIES = ("tiny-gpt-oss", "tiny-deepseek-v3")


def _family_model(preset: str, lora: bool):
    """``preset`` with DeepSeek's score correction drawn (it steers the routing); lora: every
    expert adapted, both factors drawn (a zero factor leaves the other without a gradient)."""
    from hybridflow.learners.lora import apply_lora, expert_adapters

    generator = torch.Generator().manual_seed(3)
    model = load_model(preset)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.3)
    if lora:
        apply_lora(model, rank=4, alpha=8, target_modules=["experts"])
        with torch.no_grad():
            for adapters in expert_adapters(model):
                for factor in adapters.parameters():
                    if not factor.any():
                        factor.copy_(torch.randn(factor.shape, generator=generator) * 0.1)
    return model


def _family_run(preset: str, sequences: list[int], group, lora: bool):
    """Forward + backward of the sequences' tokens: (hidden, loss, model)."""
    input_ids, _, _ = _data()
    starts = torch.tensor([0, *LENGTHS]).cumsum(0)
    take = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in sequences])
    lengths = [LENGTHS[s] for s in sequences]
    model = _family_model(preset, lora)
    if group is not None:
        keep_local_experts(model, group)
    hidden = model.forward_packed(
        input_ids[take], torch.cat([torch.arange(n) for n in lengths]),
        torch.tensor([0, *lengths]).cumsum(0).to(torch.int32), max(lengths),
    )  # fmt: skip
    projection = torch.randn(sum(LENGTHS), model.config.hidden_size,
                             generator=torch.Generator().manual_seed(7))  # fmt: skip
    loss = (hidden * projection[take]).sum()
    loss.backward()
    return hidden.detach(), loss.detach(), model


def _gathered_grads(model, group) -> dict:
    """Full gradients: the split expert tensors' concatenated, the others summed."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        if ".experts." in name:
            parts = [torch.empty_like(param.grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, param.grad, group=group)
            grads[name] = torch.cat(parts)
        else:
            dist.all_reduce(param.grad, group=group)
            grads[name] = param.grad.clone()
    return grads


def _families_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group, results = dist.group.WORLD, {}
        for preset in FAMILIES:
            for lora in (False, True):
                hidden, loss, model = _family_run(preset, [2 * rank, 2 * rank + 1], group, lora)
                experts = model.model.layers[-1].mlp.experts
                split = {name: getattr(experts, name).shape[0] for name in experts.expert_tensors}
                hiddens = [None] * world
                dist.all_gather_object(hiddens, hidden)
                dist.all_reduce(loss)
                results[preset, lora] = dict(hidden=torch.cat(hiddens), loss=loss, split=split,
                                             grads=_gathered_grads(model, group))  # fmt: skip
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "families.pt"))
        dist.barrier()
    finally:
        leave_group()


def test_two_ep_ranks_split_biased_and_grouped_experts_as_one_process(tmp_path):
    """GPT-OSS's biased experts (each expert's biases on its rank, the router's bias whole)
    and DeepSeek-V3's grouped-routed experts (the shared experts and the score correction
    whole) over EP = 2: hidden states, loss and every gradient of one process in fp32; with
    LoRA on the experts, the adapters' factors split with them and only they get gradients."""
    start_ranks(_families_worker, 2, str(tmp_path))
    results = torch.load(tmp_path / "families.pt", weights_only=True)
    for preset in FAMILIES:
        for lora in (False, True):
            ep = results[preset, lora]
            hidden, loss, model = _family_run(preset, [0, 1, 2, 3], None, lora)
            experts = model.config.num_experts
            assert set(ep["split"].values()) == {experts // 2}, ep["split"]
            assert _relative(ep["hidden"], hidden) < 1e-5, preset
            assert _relative(ep["loss"], loss) < 1e-5, preset
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert sorted(ep["grads"]) == sorted(grads)
            if lora:
                assert all(".experts.lora." in name for name in grads) and len(grads) > 0
            else:  # the experts' biases (GPT-OSS) and the router's are among them
                assert any(name.endswith("experts.down_proj_bias") for name in grads) == (
                    preset == "tiny-gpt-oss")  # fmt: skip
            for name, grad in grads.items():
                assert _relative(ep["grads"][name], grad) < 1e-5, (preset, name)
