"""The host side of one Engine.generate() call: requests waiting for a slot, live rows, their
budgets and the tokens read back so far.

Each turn: admit waiting requests into free slots (one packed prefill per unique prompt, its
KV fanned out to the n sample slots, first tokens sampled), queue a chunk of decode steps
(graph replays, no host sync) and pinned copies of the rows' flags and newest tokens; then
read the previous chunk's copies (EngineOptions.sync_lag) while the GPU runs this chunk: extend each
request's lists, retire finished requests, free and compact their rows.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridflow.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from hybridflow.engine.engine import Engine


@dataclass
class _Snapshot:
    """Copies of the decode state queued right after a chunk of steps (pinned host memory on
    CUDA), read by the host one chunk later. Rows are in the order of `requests`."""

    requests: list[int]
    finished: torch.Tensor  # [rows] bool
    generated: torch.Tensor  # [rows] tokens generated so far
    tokens: torch.Tensor  # [rows, W]: the last W output columns up to `generated`
    logprobs: torch.Tensor  # [rows, W]
    ready: object  # torch.cuda.Event, or None on CPU

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class PromptTable:
    """A call's prompts as one flat int64 array, with their lengths checked up front and their
    token ids flattened and range-checked in pieces: the first admission's prompts before its
    prefill, the rest while the GPU runs it (1024 prompts x 128 tokens take ~3 ms on the CPU
    machine: host time that used to sit in front of the first kernel)."""

    def __init__(self, prompts: list[list[int]], vocab_size: int, max_seq_len: int):
        self.prompts, self.vocab_size = prompts, vocab_size
        lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
        if (lengths == 0).any():
            raise ValueError(f"prompt {int(np.argmax(lengths == 0))} is empty")
        if (lengths >= max_seq_len).any():
            i = int(np.argmax(lengths >= max_seq_len))
            raise ValueError(
                f"prompt {i} has {lengths[i]} tokens; max_seq_len={max_seq_len} "
                "leaves no room to generate: raise max_seq_len"
            )
        self.lengths = lengths
        self.offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
        self.flat = np.empty(int(self.offsets[-1]), dtype=np.int64)
        self.checked = 0  # prompts [0, checked) are flattened and in range

    def check(self, upto: int | None = None) -> None:
        """Flatten and range-check prompts [checked, upto) (all by default); ValueError names
        the first prompt with an id outside the vocabulary."""
        upto = len(self.prompts) if upto is None else upto
        if upto <= self.checked:
            return
        begin, end = int(self.offsets[self.checked]), int(self.offsets[upto])
        piece = np.fromiter(
            itertools.chain.from_iterable(self.prompts[self.checked : upto]),
            dtype=np.int64,
            count=end - begin,
        )
        bad = (piece < 0) | (piece >= self.vocab_size)
        if bad.any():
            at = begin + int(np.argmax(bad))
            i = int(np.searchsorted(self.offsets, at, side="right")) - 1
            raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
        self.flat[begin:end] = piece
        self.checked = upto

    def tokens(self, first: int, last: int) -> torch.Tensor:
        """Prompts [first, last) concatenated (int64, CPU)."""
        self.check(last)
        return torch.from_numpy(self.flat[self.offsets[first] : self.offsets[last]])


class GenerationLoop:
    """Host-side bookkeeping of one generate() call: requests, slots, rows, results."""

    def __init__(self, engine: Engine, table: PromptTable, params: SamplingParams, seed_lo,
                 seed_hi, keep: bool = False, reuse: list | None = None):  # fmt: skip
        self.engine, self.table, self.params = engine, table, params
        prompts = self.prompts = table.prompts
        self.state, self.runner, self.cache = engine.state, engine.runner, engine.cache
        self.seed_lo, self.seed_hi = seed_lo, seed_hi
        n = params.n
        self.waiting = deque(range(len(prompts) * n))  # request id = prompt * n + sample
        self.max_new = [
            min(params.max_new_tokens, engine.max_seq_len - len(p))
            for p in prompts
            for _ in range(n)
        ]
        self.stop_ids = set(engine._stop_ids(params))
        # kept KV (kept.py): keep finished requests' slots; continue requests in theirs
        self.keep = keep
        self.extending: deque[tuple[int, int, int]] = deque()  # (request, slot, cached length)
        if reuse is not None:
            if n != 1 or len(reuse) != len(prompts):
                raise ValueError("reuse: one handle (or None) per prompt, with n = 1")
            self.waiting = deque()
            for request, handle in enumerate(reuse):
                taken = engine.kept.take(handle, prompts[request])
                if taken is None:
                    self.waiting.append(request)
                else:
                    self.extending.append((request, *taken))
        busy = engine.kept.slots() | {slot for _, slot, _ in self.extending}
        self.free_slots = [s for s in range(self.cache.num_slots - 1, -1, -1) if s not in busy]
        self.row_request: list[int] = []  # request id of each live row
        self.row_slot: list[int] = []  # its cache slot
        self.row_budget: list[int] = []  # upper bound on steps each row may still take
        self.row_end: list[int] = []  # prompt length + max_new: bound on the row's cache length
        self.row_admission: list[int] = []  # which admission prefilled each row's prompt
        self.admissions = 0
        # tokens and log-probs read back so far, per live request
        self.partial: dict[int, tuple[list[int], list[float]]] = {}
        # (token_ids, logprobs, finish_reason) per request
        self.results: list[tuple | None] = [None] * len(self.max_new)
        # output columns a snapshot reads per row: a chunk's steps + the admission's token
        self.window = engine.steps_per_sync + 1
        self.columns = torch.arange(self.window, device=engine.device)
        # Host reads lag the device by one chunk: the next chunk's replays are queued before
        # the host waits for the previous chunk's flags and tokens, so the GPU does not idle
        # while the host compacts rows, admits prompts and turns tokens into lists (H200,
        # 0.5b: 171k vs 162k tok/s at 256 rows, 242k vs 227k at 1024).
        self.lagged = engine.sync_lag > 0

    def run(self) -> list[tuple]:
        pending = None
        while self.waiting or self.extending or self.row_request or pending is not None:
            # Admit until the slots or the queue run out (several prefill passes back to back):
            # rows admitted later would otherwise trail the first ones by a whole chunk of
            # steps at a smaller batch (an H200 profile of 256 prompts showed 15 steps at 128 rows).
            while self.extending:
                self._admit_extension()
            while self.waiting and self._should_admit():
                self._admit()
                self.table.check()  # the rest, while the GPU runs the first prefill (once)
            steps = min(self.engine.steps_per_sync, max(self.row_budget, default=0))
            if steps > 0:
                self._decode(steps)
            snapshot = None
            if self.row_request and (steps > 0 or pending is None):
                snapshot = self._snapshot()
            if pending is not None:
                self._absorb(pending)  # the GPU runs the chunk just queued meanwhile
            if snapshot is not None and (not self.lagged or steps == 0):
                self._absorb(snapshot)  # nothing queued to overlap with: read it now
                snapshot = None
            pending = snapshot
        return self.results

    def _decode(self, steps: int) -> None:
        self.runner.decode_steps(len(self.row_request), steps, self._max_live_len(steps))
        self.row_budget = [b - steps for b in self.row_budget]

    def _should_admit(self) -> bool:
        # Prefill in batches: wait until a useful share of the slots is free (amortises the
        # eager prefill) unless nothing is decoding or the queue is short.
        free = len(self.free_slots)
        want = min(len(self.waiting), max(1, self.cache.num_slots // 8))
        while free < want and len(self.engine.kept):  # kept KV gives way, oldest first
            self.free_slots.append(self.engine.kept.evict_oldest())
            free += 1
        return free > 0 and (
            not self.row_request
            or free >= min(len(self.waiting), max(1, self.cache.num_slots // 8))
        )

    def _max_live_len(self, steps: int) -> int:
        """Host upper bound on cache positions read during the next `steps` steps (eager torch
        decode reads only these); no device sync needed."""
        bound = max(end - budget + steps for end, budget in zip(self.row_end, self.row_budget))
        return min(self.cache.max_seq_len, bound)

    def _admit(self) -> None:
        engine, params = self.engine, self.params
        taken: list[int] = []
        tokens = 0
        while self.waiting and len(taken) < len(self.free_slots):
            request = self.waiting[0]
            if taken and request != taken[-1] + 1:  # one pass packs consecutive requests
                break
            prompt_len = len(self.prompts[request // params.n])
            new_prompt = not taken or taken[-1] // params.n != request // params.n
            if new_prompt and taken and tokens + prompt_len > engine.max_prefill_tokens:
                break
            tokens += prompt_len if new_prompt else 0
            taken.append(self.waiting.popleft())
        slots = [self.free_slots.pop() for _ in taken]
        engine.prefill_tokens += tokens
        device = engine.device
        # One prefill per unique prompt (its first request's slot), then KV fan-out.
        firsts: list[int] = []  # index into `taken` of each unique prompt's first request
        group: list[int] = []  # unique-prompt index of each taken request
        for i, request in enumerate(taken):
            if not firsts or taken[firsts[-1]] // params.n != request // params.n:
                firsts.append(i)
            group.append(len(firsts) - 1)
        # the taken requests are consecutive ids, so their prompts are a consecutive range
        assert taken[-1] - taken[0] == len(taken) - 1, "requests are admitted in order"
        first_prompt, last_prompt = taken[0] // params.n, taken[-1] // params.n + 1
        lengths = torch.from_numpy(self.table.lengths[first_prompt:last_prompt])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        group_t = torch.tensor(group)
        first_slots = torch.tensor([slots[i] for i in firsts])
        # Prefix fan-out (n > 1): positions [0, len) of each prompt's first slot to the
        # slots of its other samples, as flat (src slot, dst slot, position) index lists.
        first_set = set(firsts)
        copies = torch.tensor(
            [i for i in range(len(taken)) if i not in first_set], dtype=torch.long
        )
        copy_lengths = lengths[group_t[copies]]
        copy_src = torch.repeat_interleave(first_slots[group_t[copies]], copy_lengths)
        copy_dst = torch.repeat_interleave(torch.tensor(slots)[copies], copy_lengths)
        copy_pos = ranges(copy_lengths)
        (
            ids, positions, token_slots, cu_dev, group_dev, seed_lo, seed_hi, row_positions,
            row_slots, max_new_dev, copy_src, copy_dst, copy_pos,
        ) = upload(
            device,
            self.table.tokens(first_prompt, last_prompt), ranges(lengths),
            torch.repeat_interleave(first_slots, lengths), cu, group_t,
            torch.tensor([self.seed_lo[r] for r in taken]),
            torch.tensor([self.seed_hi[r] for r in taken]), lengths[group_t],
            torch.tensor(slots), torch.tensor([self.max_new[r] for r in taken]),
            copy_src, copy_dst, copy_pos,
        )  # fmt: skip
        logits = engine.prefill(
            engine.model, self.cache, engine.rope, ids, positions, token_slots,
            cu_dev.to(torch.int32), int(lengths.max()), cu_dev[1:] - 1,
        )  # fmt: skip  # [U, V]
        if copy_pos.numel():
            self.cache.copy_positions(copy_src, copy_dst, copy_pos)
        request_logits = logits[group_dev]  # [R, V]
        first_tokens, first_logprobs = self.runner.sample(
            request_logits, seed_lo, seed_hi, torch.zeros_like(seed_lo)
        )
        max_new = [self.max_new[r] for r in taken]
        self.state.append_rows(
            first_tokens, first_logprobs, row_positions, row_slots, max_new_dev, seed_lo, seed_hi
        )
        self.row_request += taken
        self.row_slot += slots
        for request in taken:
            self.partial[request] = ([], [])
        self.row_budget += [m - 1 for m in max_new]
        prompt_lengths = lengths.tolist()
        self.row_end += [prompt_lengths[g] + m for g, m in zip(group, max_new)]
        self.row_admission += [self.admissions] * len(taken)
        self.admissions += 1
        self._upload_groups()

    def _admit_extension(self) -> None:
        """Admit requests that continue a kept slot: only the tokens past the cached prefix
        are prefilled (Engine.extend), into the same slot."""
        engine = self.engine
        self.table.check()  # every id in range before it indexes the embedding
        taken, tokens = [], 0
        while self.extending:
            request, slot, cached = self.extending[0]
            new = len(self.prompts[request]) - cached
            if taken and tokens + new > engine.max_prefill_tokens:
                break
            taken.append(self.extending.popleft())
            tokens += new
        engine.prefill_tokens += tokens
        requests = [request for request, _, _ in taken]
        slots = [slot for _, slot, _ in taken]
        lengths = [len(self.prompts[r]) for r in requests]
        starts = torch.tensor([cached for _, _, cached in taken])
        counts = torch.tensor(lengths) - starts
        ids = torch.tensor([t for (r, _, c) in taken for t in self.prompts[r][c:]])
        positions = ranges(counts) + torch.repeat_interleave(starts, counts)
        (ids, positions, token_slots, last, seed_lo, seed_hi, row_positions, row_slots,
         max_new_dev) = upload(
            engine.device, ids, positions, torch.repeat_interleave(torch.tensor(slots), counts),
            counts.cumsum(0) - 1, torch.tensor([self.seed_lo[r] for r in requests]),
            torch.tensor([self.seed_hi[r] for r in requests]), torch.tensor(lengths),
            torch.tensor(slots), torch.tensor([self.max_new[r] for r in requests]),
        )  # fmt: skip
        logits = engine.extend(engine.model, self.cache, engine.rope, ids, positions,
                               token_slots, last)  # fmt: skip  # [R, V]
        first_tokens, first_logprobs = self.runner.sample(
            logits, seed_lo, seed_hi, torch.zeros_like(seed_lo)
        )
        self.state.append_rows(first_tokens, first_logprobs, row_positions, row_slots,
                               max_new_dev, seed_lo, seed_hi)  # fmt: skip
        max_new = [self.max_new[r] for r in requests]
        self.row_request += requests
        self.row_slot += slots
        for request in requests:
            self.partial[request] = ([], [])
        self.row_budget += [m - 1 for m in max_new]
        self.row_end += [length + m for length, m in zip(lengths, max_new)]
        self.row_admission += [self.admissions] * len(requests)
        self.admissions += 1
        self._upload_groups()

    def _snapshot(self) -> _Snapshot:
        """Queue copies of the live rows' flags, counts and newest output columns."""
        state, rows = self.state, len(self.row_request)
        generated = state.generated[:rows]
        columns = (generated[:, None] - self.window + self.columns[None, :]).clamp_(min=0)
        slots = state.row_slots[:rows, None]
        parts = [state.finished[:rows], generated, state.out_tokens[slots, columns],
                 state.out_logprobs[slots, columns]]  # fmt: skip
        ready = None
        if self.engine.device.type == "cuda":
            host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts]
            for h, p in zip(host, parts):
                h.copy_(p, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            parts = host
        else:
            parts = [p.clone() for p in parts]
        return _Snapshot(list(self.row_request), *parts, ready)

    def _absorb(self, snapshot: _Snapshot) -> None:
        """Append a snapshot's new tokens to each request's lists; retire finished rows."""
        collect_young(snapshot.ready)  # while the GPU is still busy, if there is work for it
        snapshot.wait()
        finished = snapshot.finished.tolist()
        generated = snapshot.generated.tolist()
        tokens, logprobs = snapshot.tokens.tolist(), snapshot.logprobs.tolist()
        width = self.window
        done = set()
        for row, request in enumerate(snapshot.requests):
            lists = self.partial.get(request)
            if lists is None:  # retired by an earlier snapshot
                continue
            new = generated[row] - len(lists[0])
            if new > 0:
                lists[0].extend(tokens[row][width - new :])
                lists[1].extend(logprobs[row][width - new :])
            if finished[row]:
                done.add(request)
        if done:
            self._retire(done)

    def _retire(self, done: set[int]) -> None:
        """Record finished requests' results, free their slots and compact the live rows."""
        keep = []
        for row, request in enumerate(self.row_request):
            if request not in done:
                keep.append(row)
                continue
            tokens, logprobs = self.partial.pop(request)
            reason = "stop" if tokens and tokens[-1] in self.stop_ids else "length"
            if self.keep:  # the slot holds the prompt and every token but the last
                prompt = self.prompts[request // self.params.n]
                handle = self.engine.kept.keep(self.row_slot[row], [*prompt, *tokens[:-1]])
                self.results[request] = (tokens, logprobs, reason, handle)
            else:
                self.results[request] = (tokens, logprobs, reason)
                self.free_slots.append(self.row_slot[row])
        self.state.keep_rows(keep, upload(self.engine.device, torch.tensor(keep))[0])
        self.row_request = [self.row_request[r] for r in keep]
        self.row_slot = [self.row_slot[r] for r in keep]
        self.row_budget = [self.row_budget[r] for r in keep]
        self.row_end = [self.row_end[r] for r in keep]
        self.row_admission = [self.row_admission[r] for r in keep]
        self._upload_groups()

    def _upload_groups(self) -> None:
        """The live rows' shared-prefix groups into the state (rows changed): queued before
        the next decode chunk, which reads them (shared_prefix.py)."""
        if not self.runner.shared:
            return
        from hybridflow.engine.kernels.shared_prefix import group_table

        n, lengths = self.params.n, self.table.lengths
        prompts = [request // n for request in self.row_request]
        keys = list(zip(prompts, self.row_admission))
        groups, first = group_table(keys, [int(lengths[p]) for p in prompts], self.row_slot,
                                    self.state.capacity)  # fmt: skip
        groups_dev, first_dev = upload(self.engine.device, groups, first)
        self.state.prefix_groups.copy_(groups_dev.view(-1, 4))
        self.state.prefix_first.copy_(first_dev)


# Whether the caller of the outermost cyclic_gc_paused() had the collector on (None: not
# inside one). Nested pauses (generate() wraps _generate()) leave it alone.
_caller_collects: bool | None = None


@contextlib.contextmanager
def cyclic_gc_paused():
    """Python's cyclic garbage collector off inside (restored after). A full collection walks
    every object of the process (155 ms with torch, transformers and a 0.5b model loaded, on
    a 2-core CPU host): in the middle of generate() it stops the host while the GPU drains the
    one chunk it has queued, and it fired in some timed calls but not others (H200, 0.5b:
    runs of 0.389 vs 0.473 s at 256 rows, 1.07 vs 1.20 s at 1024). The loop's own objects are
    lists of numbers, freed by reference counting; collection resumes when the call returns
    (the young objects are collected while the host waits for the GPU: collect_young)."""
    global _caller_collects
    outermost = _caller_collects is None
    if outermost:
        _caller_collects = gc.isenabled()
        gc.disable()
    try:
        yield
    finally:
        if outermost:
            if _caller_collects:
                gc.enable()
            _caller_collects = None


def collect_young(gpu_done) -> bool:
    """Run the young-generation collection now if the caller collects, enough young objects
    are waiting, and the GPU is still busy (gpu_done: an event with query(), or None on CPU).
    Why: the result lists (one per request, hundreds of numbers each) all sit in the youngest
    generation while collection is paused, and the first allocation after the call paid for
    walking them: a 9 ms generation-0 pause after a 1024-row call on the H200, inside the
    caller's timing. Collected here, it overlaps GPU work the
    host would otherwise just wait for; the survivors move to an old generation."""
    if (
        not _caller_collects
        or gpu_done is None
        or gc.get_count()[0] < gc.get_threshold()[0]
        or gpu_done.query()
    ):
        return False
    gc.collect(1)
    return True


def ranges(lengths: torch.Tensor) -> torch.Tensor:
    """[n0, n1, ...] -> [0..n0-1, 0..n1-1, ...] (int64, CPU)."""
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)


def upload(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU int64 tensors -> device tensors through one pinned buffer and one non-blocking
    copy. (torch.tensor(list, device="cuda") copies from pageable memory, which waits for the
    GPU to drain: each admission would wait for the previous prefill pass to finish.)"""
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split(sizes))
