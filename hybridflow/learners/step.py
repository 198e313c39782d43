"""One optimizer step over a mini-batch: micro-batches, gradient accumulation, clip, step.

Shared by the actor and the critic; only the per-micro-batch loss differs. Following
``hybridflow.algos.aggregation``, each micro-batch loss is normalised by the counts of the
whole mini-batch over every rank and back-propagated as is (times the FSDP size, because FSDP
averages gradients over the ranks that shard the parameters), so the accumulated gradient
equals the one-batch gradient. Under Ulysses the ranks of a sequence-parallel group compute
the same loss from gathered log-probs, each back-propagating its own tokens' part
(learners/modules.py); FSDP shards over them too, so the same factor sums those parts.
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


def mini_batch_plan(
    num_rows: int, mini_batch_size: int, shards: int, order_of: Callable[[int], torch.Tensor]
) -> list[torch.Tensor]:
    """Rows of each mini-batch of a batch of ``num_rows`` rows made of ``shards`` equal
    consecutive shards; ``order_of(n)`` is the row order (a permutation of ``n`` rows) the
    learner walks, applied within each shard.

    The ranks of one sequence-parallel group gather the shards the controller sent each of
    them; taking every mini-batch evenly from the shards, in the order one data-parallel rank
    would, gives the mini-batches that data parallelism over the same ranks takes. When the
    mini-batch does not split evenly over the shards, it is cut from the whole batch."""
    count = num_rows // mini_batch_size
    if shards > 1 and mini_batch_size % shards == 0 and num_rows % shards == 0:
        shard_rows, per_shard = num_rows // shards, mini_batch_size // shards
        order = order_of(shard_rows)
        return [
            torch.cat([order[m * per_shard : (m + 1) * per_shard] + s * shard_rows
                       for s in range(shards)])
            for m in range(count)
        ]  # fmt: skip
    order = order_of(num_rows)
    return [order[m * mini_batch_size : (m + 1) * mini_batch_size] for m in range(count)]


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
        (loss * (core.groups.shard_size * weight)).backward()
        if rows:
            sums.add_token_means(token_means, float(micro.tensors["response_mask"].sum()))
            sums.add_mini_batch_terms(terms)
    core.finish_gradients()
    grad_norm, skipped = core.optimizer_step(grad_clip)
    sums.add_step(grad_norm, skipped)
    sums.last_lr = core.optimizer.param_groups[0]["lr"]
    core.scheduler_step()
    return skipped
