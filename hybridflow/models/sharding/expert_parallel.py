"""Expert parallelism: each rank of an expert-parallel (EP) group holds E / EP of a sparse
layer's experts, and the tokens travel to the experts that route them.

One sparse layer's forward on a rank (GShard, arXiv:2006.16668, section 3.2):

    route -> sort the (token, expert) assignments by expert, so by destination rank
          -> exchange the counts (rows per local expert from every source rank)
          -> all-to-all the assignment rows             [T*k, H] out, [R, H] in
          -> the local experts' grouped GEMMs over the R received rows
          -> the reverse all-to-all, back to the sending order
          -> weight by the gate and sum each token's k results, as on one process.

Both all-to-alls are differentiable (:class:`AllToAllRows`: the backward is the opposite
all-to-all), so the gradient of a local expert's weights sums over every token routed to it
from the whole EP group, and each token's hidden state gets the gradient of its k experts.
Routing replay needs nothing here: the ids to dispatch are whichever the router or the
replayed routes chose. gloo's ``all_to_all_single`` takes uneven splits on the CPU, so the
same collective runs in the CPU tests and over NCCL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.models.moe import ExpertLoRA, SparseMoeBlock, moe_experts


class AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; the backward sends the gradient rows
    back the way they came (the splits swapped)."""

    @staticmethod
    def forward(ctx, rows, send_counts: list[int], recv_counts: list[int], group):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        received = rows.new_empty(sum(recv_counts), *rows.shape[1:])
        dist.all_to_all_single(received, rows.contiguous(), recv_counts, send_counts, group=group)
        return received

    @staticmethod
    def backward(ctx, grad_received):
        grad_rows = grad_received.new_empty(sum(ctx.send_counts), *grad_received.shape[1:])
        dist.all_to_all_single(
            grad_rows, grad_received.contiguous(), ctx.send_counts, ctx.recv_counts,
            group=ctx.group,
        )  # fmt: skip
        return grad_rows, None, None, None


def exchange_counts(counts_per_expert: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """counts_per_expert [E] (rows this rank sends to each global expert) -> [EP, E/EP]: row s
    holds the rows rank s sends to each of this rank's local experts."""
    size = dist.get_world_size(group)
    received = torch.empty_like(counts_per_expert)
    dist.all_to_all_single(received, counts_per_expert.contiguous(), group=group)
    return received.view(size, -1)


def local_expert_of_received(received_counts: torch.Tensor) -> torch.Tensor:
    """received_counts [EP, E_local] -> the local expert [R] of each received row, the rows
    being ordered by source rank, then by expert within a source (as the senders sorted
    them)."""
    local_experts = received_counts.shape[1]
    ids = torch.arange(local_experts, device=received_counts.device).repeat(
        received_counts.shape[0]
    )
    return ids.repeat_interleave(received_counts.reshape(-1))


def expert_parallel_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    group: dist.ProcessGroup,
    backend: str = "auto",
    adapters: ExpertLoRA | None = None,
    *,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`~hybridflow.models.moe.moe_experts` with the experts spread over ``group``.

    hidden [T, H], topk_ids [T, k] global expert ids, topk_weights [T, k]; gate_up
    [E/EP, 2I, H] and down [E/EP, H, I]: this rank's experts, rank r holding experts
    r*E/EP .. (r+1)*E/EP - 1 (adapters, biases: theirs; activation as moe_experts') ->
    [T, H] in hidden's dtype. Every rank of ``group`` must call it (with T = 0 if it has
    no tokens). run_local: runs this rank's experts on the received rows instead of
    moe_experts over gate_up and down (rows [R, H], their local expert ids [R, 1] -> [R, H],
    each row its expert's output unweighted: the engine's grouped Triton kernels)."""
    num_tokens, top_k = topk_ids.shape
    ep_size, local_experts = dist.get_world_size(group), gate_up.shape[0]
    num_experts = ep_size * local_experts
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = flat_ids.argsort(stable=True)  # by expert, so by destination rank
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]
    received_counts = exchange_counts(counts, group)  # [EP, E/EP]
    send_splits = counts.view(ep_size, local_experts).sum(dim=1).tolist()
    recv_splits = received_counts.sum(dim=1).tolist()
    rows = hidden[order // top_k]  # [T*k, H]
    received = AllToAllRows.apply(rows, send_splits, recv_splits, group)  # [R, H]
    local_ids = local_expert_of_received(received_counts)[:, None]  # [R, 1]
    # One assignment per received row with gate weight 1: the local grouped GEMMs, exact
    # in any dtype (x * 1.0); the gate weights apply below, on the sending rank.
    if run_local is not None:
        expert_out = run_local(received, local_ids)
    else:
        unit = torch.ones(local_ids.shape, dtype=torch.float32, device=hidden.device)
        expert_out = moe_experts(received, local_ids, unit, gate_up, down, backend, adapters,
                                 activation=activation, biases=biases)  # fmt: skip
    returned = AllToAllRows.apply(expert_out, recv_splits, send_splits, group)  # [T*k, H]
    unsorted = torch.empty_like(returned).index_copy_(0, order, returned)
    weighted = (
        unsorted.view(num_tokens, top_k, hidden.shape[-1]).float() * topk_weights[..., None].float()
    )
    return weighted.sum(dim=1).to(hidden.dtype)


def local_expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """[first, last + 1) of the experts EP rank ``ep_rank`` holds (contiguous blocks)."""
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over {ep_size} EP ranks")
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def expert_blocks(causal_lm: nn.Module) -> list[nn.Module]:
    """The sparse layers' MLPs whose experts expert parallelism splits: models/moe's
    SparseMoeBlock and its kinds (DeepSeek's grouped router and shared experts, Qwen3.5's
    shared expert), GPT-OSS's biased experts."""
    from hybridflow.models.mlps.biased_experts import BiasedExpertsMoeBlock

    kinds = (SparseMoeBlock, BiasedExpertsMoeBlock)
    return [block for block in causal_lm.modules() if isinstance(block, kinds)]


def split_tensors(experts: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of every tensor of ``experts`` with the expert axis first:
    its projections (GPT-OSS's biases too) and their LoRA factors."""
    owned = [(experts, name) for name in experts.expert_tensors]
    if experts.lora is not None:
        owned += [(experts.lora, name) for name, _ in experts.lora.named_parameters()]
    return owned


def keep_local_experts(causal_lm: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Cut every sparse layer of ``causal_lm`` (a full model, the same on every rank) down to
    this rank's experts of the EP ``group`` (each expert's biases and LoRA factors with it)
    and make the layer dispatch over it. The router (its bias, DeepSeek's score correction)
    and the shared experts stay whole: every rank routes its tokens over all E experts."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for block in expert_blocks(causal_lm):
        first, stop = local_expert_range(block.num_experts, rank, size)
        for module, name in split_tensors(block.experts):
            full = getattr(module, name)
            part = torch.nn.Parameter(full.detach()[first:stop].clone(), full.requires_grad)
            setattr(module, name, part)
        block.expert_group, block.expert_dispatch = group, expert_parallel_moe
