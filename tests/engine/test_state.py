"""DecodeState's host-side helpers (CPU)."""

from __future__ import annotations

import torch

from hybridflow.engine.state import DecodeState


def test_move_to_middle_puts_rows_halfway_through_what_they_may_still_generate():
    """The graph warm-up tunes kernels with rows moved there (DecodeRunner._graph): a row
    with 9 tokens allowed and 1 generated moves 4 positions on, a row with 1 allowed stays,
    a row past max_len is clamped, and padding rows (finished, position 0) stay at 0."""
    state = DecodeState(rows=5, num_slots=4, max_seq_len=32, vocab_size=16, device="cpu")
    zeros = torch.zeros(4)
    state.append_rows(
        torch.tensor([1, 2, 3, 4]), zeros, torch.tensor([5, 10, 7, 28]),
        torch.tensor([0, 1, 2, 3]), torch.tensor([9, 4, 1, 20]), torch.arange(4),
        torch.arange(4),
    )  # fmt: skip
    assert state.generated[:4].tolist() == [1, 1, 1, 1]
    state.move_to_middle(rows=5, max_len=32)
    assert state.positions.tolist() == [5 + 4, 10 + 1, 7, 31, 0]
    assert state.generated[:4].tolist() == [1, 1, 1, 1]  # only positions move
