"""One optimizer step over a mini-batch: micro-batches, gradient accumulation, clip, step.

Shared by the actor and the critic; only the per-micro-batch loss differs. Following
``hybridflow.algos.aggregation``, each micro-batch loss is normalised by the counts of the
whole mini-batch over every rank and back-propagated as is (times the DP size, because FSDP
averages gradients over ranks), so the accumulated gradient equals the one-batch gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.learners.core import TrainCore
from hybridflow.learners.metric_sums import MetricSums
from hybridflow.learners.packing import PackedRows
from hybridflow.learners.response_forward import pack_batch_rows
from hybridflow.protocol import Batch

# (micro-batch rows, their packed inputs, global normalisers) -> (loss, loss terms, token means)
MicroLoss = Callable[
    [Batch, PackedRows, dict],
    tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]],
]


def mini_batch_count(num_rows: int, mini_batch_size: int) -> int:
    """Optimizer steps per epoch for ``num_rows`` samples on this rank."""
    if mini_batch_size < 1 or num_rows % mini_batch_size:
        raise ValueError(
            f"{num_rows} samples on this rank cannot be cut into mini-batches of "
            f"{mini_batch_size} (ppo_mini_batch_size × rollout.n / data-parallel ranks); "
            "make the batch a multiple of the mini-batch"
        )
    return num_rows // mini_batch_size


def global_counts(core: TrainCore, response_mask: torch.Tensor) -> tuple[float, float]:
    """(valid tokens, sequences with a valid token) of a mini-batch summed over DP ranks."""
    local = torch.tensor(
        [float(response_mask.sum()), float((response_mask.sum(-1) > 0).sum())],
        dtype=torch.float64,
        device=core.comm_device(),
    )
    tokens, sequences = core.all_reduce(local).tolist()
    return tokens, sequences


def accumulate_and_step(
    core: TrainCore,
    mini: Batch,
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    grad_clip: float,
    norm_length: int,
    micro_loss: MicroLoss,
    sums: MetricSums,
) -> bool:
    """Forward/backward every micro-batch of ``mini``, then one clipped optimizer step.
    Returns True when the step was skipped (non-finite gradient norm)."""
    tokens, sequences = global_counts(core, mini.tensors["response_mask"])
    counts = {
        "global_token_count": tokens,
        "global_seq_count": sequences,
        "norm_length": norm_length,
    }
    plan = core.plan_micro_batches(mini.tensors["attention_mask"], micro_batch_size, max_tokens)
    for index, rows in enumerate(plan):
        core.accumulation_phase(last=index == len(plan) - 1)
        # An empty micro-batch (this rank has fewer than another) runs one row with weight 0,
        # so every rank joins the same FSDP collectives.
        weight = 1.0 if rows else 0.0
        micro = mini.index(rows or [0])
        packed = pack_batch_rows(micro, list(range(len(micro))), core.device)
        with core.autocast():
            loss, terms, token_means = micro_loss(micro, packed, counts)
        (loss * (core.dp_size * weight)).backward()
        if rows:
            sums.add_token_means(token_means, float(micro.tensors["response_mask"].sum()))
            sums.add_mini_batch_terms(terms)
    grad_norm, skipped = core.optimizer_step(grad_clip)
    sums.add_step(grad_norm, skipped)
    sums.last_lr = core.optimizer.param_groups[0]["lr"]
    core.scheduler_step()
    return skipped
