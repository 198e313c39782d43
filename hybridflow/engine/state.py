"""Device-side decode state: one row per running sequence, updated without host syncs.

Rows [0, num_rows) are live sequences; a decode step of bucket size b runs rows [0, b), the
rows past num_rows being padding (finished, pointing at the cache's scratch slot). The host
touches this state only between chunks of decode steps: to compact finished rows away and to
append newly prefilled ones.
"""

from __future__ import annotations

import torch


class DecodeState:
    def __init__(self, rows: int, num_slots: int, max_seq_len: int, vocab_size: int, device):
        self.capacity = rows
        self.scratch_slot = num_slots
        long = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros(rows, **long)  # last sampled token = next input
        self.positions = torch.zeros(rows, **long)  # cache position the next input goes to
        self.row_slots = torch.full((rows,), num_slots, **long)
        self.generated = torch.zeros(rows, **long)  # tokens generated so far (= sampling step)
        self.max_new = torch.ones(rows, **long)
        self.seed_lo = torch.zeros(rows, **long)
        self.seed_hi = torch.zeros(rows, **long)
        self.finished = torch.ones(rows, dtype=torch.bool, device=device)
        # Each row's sampling settings, read only when the live rows mix settings (a
        # uniform batch runs the sampler specialised for its one setting: graphs.py).
        self.temperature = torch.ones(rows, device=device)  # 0 = greedy
        self.top_k = torch.zeros(rows, **long)  # <= 0: off
        self.top_p = torch.ones(rows, device=device)
        self.min_p = torch.zeros(rows, device=device)
        self.stop_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self._stop_host = self._stop_copied = None  # pinned staging buffer (CUDA)
        # shared_prefix groups of the live rows (rewritten by the loop when rows change)
        self.prefix_groups = torch.zeros(rows + 1, 4, dtype=torch.int32, device=device)
        self.prefix_first = torch.zeros(rows, **long)
        # Outputs are per slot (rows move when compacted, slots do not); +1 column so finished
        # rows can keep writing harmlessly one past their end.
        self.out_tokens = torch.zeros(num_slots + 1, max_seq_len + 1, **long)
        self.out_logprobs = torch.zeros(num_slots + 1, max_seq_len + 1, device=device)
        self.num_rows = 0
        self._row_fields = (
            self.tokens, self.positions, self.row_slots, self.generated, self.max_new,
            self.seed_lo, self.seed_hi, self.finished, self.temperature, self.top_k, self.top_p,
            self.min_p,
        )  # fmt: skip

    def set_stop_tokens(self, stop_ids: list[int]) -> None:
        """Built on the host and copied without a sync (a pageable copy would wait for the
        GPU's queue, e.g. the fused-weight refresh generate() has just launched), from one
        pinned buffer kept for the engine's life (a fresh pinned tensor per call can mean a
        cudaHostAlloc: up to ~5 ms of host time at a call's start on the H200). Ids outside the vocabulary (a tokenizer's eos on a smaller model) can never be
        sampled: ignored."""
        reachable = [i for i in stop_ids if 0 <= i < self.stop_mask.shape[0]]
        if not self.stop_mask.is_cuda:
            self.stop_mask.zero_()
            self.stop_mask[reachable] = True
            return
        if self._stop_host is None:
            self._stop_host = torch.zeros(self.stop_mask.shape, dtype=torch.bool,
                                          pin_memory=True)  # fmt: skip
            self._stop_copied = torch.cuda.Event()
        else:
            self._stop_copied.synchronize()  # the last call's copy (long done) read it
        self._stop_host.zero_()
        self._stop_host[reachable] = True
        self.stop_mask.copy_(self._stop_host, non_blocking=True)
        self._stop_copied.record(torch.cuda.current_stream(self.stop_mask.device))

    def keep_rows(self, keep: list[int], index: torch.Tensor | None = None) -> None:
        """Compact: rows `keep` (in that order) become rows [0, len(keep)); the rest padding.
        index: `keep` already on the device (uploaded without a sync; else made here)."""
        if keep != list(range(len(keep))):
            if index is None:
                index = torch.tensor(keep, dtype=torch.int64, device=self.tokens.device)
            for field in self._row_fields:
                field[: len(keep)] = field[index]
        self.num_rows = len(keep)
        self._reset_padding()

    def move_to_middle(self, rows: int, max_len: int) -> None:
        """Rows [0, rows) jump halfway through the tokens they may still generate (cache
        positions in between are read as whatever they hold: zeros or stale K/V, finite).
        For warm-up steps that tune kernels at representative lengths; the caller restores
        the fields after (graphs.DecodeRunner._graph)."""
        ahead = (self.max_new[:rows] - self.generated[:rows]).clamp_(min=0) // 2
        self.positions[:rows] = (self.positions[:rows] + ahead).clamp_(max=max_len - 1)

    def _reset_padding(self) -> None:
        n = self.num_rows
        self.finished[n:] = True
        self.row_slots[n:] = self.scratch_slot
        self.positions[n:] = 0
        self.generated[n:] = 0

    def append_rows(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        max_new: torch.Tensor,
        seed_lo: torch.Tensor,
        seed_hi: torch.Tensor,
        generated: torch.Tensor | None = None,
    ) -> None:
        """New sequences whose prompt is prefilled and first token sampled (step 0), all [R].
        generated: rows that resume with this many tokens already generated, `tokens` the
        last of them (a preempted request: scheduler._resume)."""
        start, count = self.num_rows, tokens.shape[0]
        rows = slice(start, start + count)
        done = 1 if generated is None else generated
        column = 0 if generated is None else generated - 1
        self.out_tokens[slots, column] = tokens
        self.out_logprobs[slots, column] = logprobs
        self.tokens[rows] = tokens
        self.positions[rows] = positions
        self.row_slots[rows] = slots
        self.generated[rows] = done
        self.max_new[rows] = max_new
        self.seed_lo[rows] = seed_lo
        self.seed_hi[rows] = seed_hi
        self.finished[rows] = self.stop_mask[tokens] | (max_new <= done)
        self.num_rows = start + count

    def set_row_sampling(self, first: int, modes: list[tuple]) -> None:
        """Rows [first, first + len(modes)) sample with these (temperature, top_k, top_p,
        min_p) settings (SamplingParams.mode_key()). One setting for all: four fills, no copy."""
        rows = slice(first, first + len(modes))
        fields = (self.temperature, self.top_k, self.top_p, self.min_p)
        if all(mode == modes[0] for mode in modes):
            for field, value in zip(fields, modes[0]):
                field[rows] = value
            return
        values = torch.tensor(modes, dtype=torch.float64).T  # [4, R]
        if self.tokens.is_cuda:
            values = values.pin_memory().to(self.tokens.device, non_blocking=True)
        for field, column in zip(fields, values):
            field[rows] = column.to(field.dtype)


def advance(state: DecodeState, rows: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """Record one sampled token per row [rows] and advance unfinished rows (no host sync)."""
    live = ~state.finished[:rows]
    slots = state.row_slots[:rows]
    columns = state.generated[:rows]
    state.out_tokens[slots, columns] = tokens
    state.out_logprobs[slots, columns] = logprobs
    generated = columns + live
    stop = state.stop_mask[tokens] | (generated >= state.max_new[:rows])
    state.finished[:rows] |= stop
    state.tokens[:rows] = torch.where(live, tokens, state.tokens[:rows])
    state.positions[:rows] += live
    state.generated[:rows] = generated
