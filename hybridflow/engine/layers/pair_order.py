"""Expert pairs (token, expert) sorted into runs by expert for the grouped matmuls, and the
experts' rows put back in pair order: shared by the experts of layers/moe.py and GPT-OSS's
biased experts (layers/biased_moe.py)."""

from __future__ import annotations

import torch


def sorted_pair_rows(x, ids, num_experts: int, first_expert: int | None = None) -> tuple:
    """x [T, H], ids [T, k] -> (rows [capacity, H]: each pair's token row, sorted by expert
    in runs that end at blocks.group_ends (torch._grouped_mm's offsets); pair_index
    [capacity] int64: each row's pair, T * k for padding; blocks: kernels/experts/moe.align_pairs'
    ExpertBlocks of 16-row blocks)."""
    from hybridflow.engine.kernels.experts import moe

    pairs, top_k = ids.numel(), ids.shape[1]
    blocks = moe.align_pairs(ids, num_experts, 16, first_expert)
    sorted_pairs = blocks.sorted_pairs
    valid = (sorted_pairs < pairs) & (
        torch.arange(sorted_pairs.shape[0], device=x.device) < blocks.total
    )  # past `total` the array was never written
    pair_index = torch.where(valid, sorted_pairs, pairs).long()  # padding -> a spare row
    return x[(pair_index % pairs) // top_k], pair_index, blocks


def rows_in_pair_order(expert_rows, pair_index, pairs: int, subset: bool) -> torch.Tensor:
    """expert_rows [capacity, H] in sorted order, pair_index [capacity] (each row's pair, P
    for padding) -> [P, H] in pair order. A gather through each pair's sorted position, not a
    scatter of the rows: torch's row gather moves 16-byte vectors a row (H200, 32K prefill
    tokens: the scatter `out[pair_index] = rows` cost 1.25 ms a layer, element by element);
    the inverse permutation is a scatter of P integers only. subset: the pairs no block holds
    (experts held elsewhere) get zero rows."""
    capacity, device = pair_index.shape[0], pair_index.device
    if subset:  # a pair no block holds keeps `capacity`: past the rows, zeroed below
        position = torch.full((pairs + 1,), capacity, dtype=torch.long, device=device)
    else:
        position = torch.empty(pairs + 1, dtype=torch.long, device=device)
    # valid pair indices are distinct; the padding rows all land on the spare entry P
    position[pair_index] = torch.arange(capacity, device=device)
    position = position[:pairs]
    if not subset:  # every pair is in a block
        return expert_rows[position]
    missing = position == capacity
    out = expert_rows[position.clamp(max=capacity - 1)]
    return out.masked_fill_(missing[:, None], 0)
