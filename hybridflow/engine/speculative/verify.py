"""Verify passes (EngineOptions.speculative): while few rows decode (the long tail), a
scheduler step scores each row's draft tokens in one forward instead of queueing a chunk of
decode steps.

A row with drafts d_1..d_m (m <= speculative_draft_tokens, fewer than the tokens it may
still emit) feeds its last token and its drafts at their positions through the extend pass
(the mixed steps' path: K/V written into its slot or blocks, logits at every position);
rows with no draft feed their last token alone, as a decode step would. Every position is
sampled by the engine's sampler with the row's seed at that position's sampling step, and
the drafts are accepted by speculative sampling (acceptance.py): the row emits its accepted
drafts and the token after them, cut after a stop token.

Rejected positions are rolled back by the row's length alone: its position moves past the
emitted tokens only, so the K/V written for rejected drafts lie past the row's end, where
no attention reads (every read is bounded by the reader's position) and the row's next
token overwrites them before any read reaches them. A recurrent layer's state and a sliding
layer's ring cannot be rolled back that way: they are copied before the pass and, for the
rows that rejected drafts, restored and moved through the kept inputs again (rollback.py).

With EngineOptions.graph_verify_steps (the fused backend) the forward has static shapes and
replays as a CUDA graph (static_verify.py: the rows as decode rows, their drafts as chunks of
their slots); the acceptance and bookkeeping after it are the same.

Drafts come from the tokens read back so far, so a verify pass first reads every row back
(the pass is synchronous: no chunk overlaps the host's work) and its emitted counts are read
after it (the host's budgets stay exact). In the tail a step is a few rows' tokens against a
read of every weight, so the syncs cost little next to the tokens a pass can emit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from hybridflow.engine.host import ranges, upload
from hybridflow.engine.prefill import host_spans
from hybridflow.engine.speculative import rollback
from hybridflow.engine.speculative.acceptance import accepted_lengths, emitted_lengths
from hybridflow.engine.speculative.drafts import DraftStore, NgramIndex, propose
from hybridflow.engine.speculative.model_verify import accept_model_drafts
from hybridflow.engine.speculative.rule import SpeculationRule

if TYPE_CHECKING:
    from hybridflow.engine.options import EngineOptions
    from hybridflow.engine.requests import LiveRequest
    from hybridflow.engine.scheduling.state import SchedulerState
    from hybridflow.engine.speculative.draft_model import DraftModel

ROLLOUTS_PER_PROMPT = 16
"""Responses kept per prompt as draft sources (the latest: a group's siblings, then earlier
epochs' samples)."""


@dataclass
class SpeculationStats:
    """Counters since the engine was made (rollout metrics read their differences)."""

    passes: int = 0  # verify passes run
    rows: int = 0  # rows verified, summed over the passes
    drafted: int = 0  # draft tokens scored
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens the passes emitted (accepted + one per row, less stops)
    seconds: float = 0.0  # wall time of the passes (synchronous: drafts, forward, sync)
    off_steps: int = 0  # tail steps the measured rule decoded plain (its decode probes too)

    def since(self, earlier: SpeculationStats) -> SpeculationStats:
        """The counts of what ran after `earlier` (a copy taken then: dataclasses.replace)."""
        return SpeculationStats(*(getattr(self, f.name) - getattr(earlier, f.name)
                                  for f in fields(self)))  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """Rollout metrics: verify passes, the share of drafts accepted, and the tokens a row
        emits per pass (a decode step emits 1; 0 when no pass ran)."""
        return {
            "rollout/speculative_passes": float(self.passes),
            "rollout/speculative_acceptance_rate": self.accepted / max(self.drafted, 1),
            "rollout/speculative_tokens_per_pass": self.emitted / max(self.rows, 1),
            "rollout/speculative_seconds": self.seconds,
            "rollout/speculative_off_steps": float(self.off_steps),
        }


class Speculation:
    """The drafts of the engine's rows (an index over each live row's prompt and tokens, the
    store of finished responses) and the counters. One per engine, across its calls: the
    store is how earlier epochs' responses draft for the same prompts."""

    def __init__(self, options: EngineOptions, draft_model: DraftModel | None = None):
        self.draft_model = draft_model  # speculative="draft": its tokens, else n-gram drafts
        self.draft_tokens = options.speculative_draft_tokens
        self.max_rows = options.speculative_max_rows
        self.min_n, self.max_n = options.speculative_min_ngram, options.speculative_max_ngram
        self.store = DraftStore(options.speculative_store_tokens, ROLLOUTS_PER_PROMPT,
                                self.min_n, self.max_n)  # fmt: skip
        self.contexts: dict[int, NgramIndex] = {}  # LiveRequest.key -> its prompt and tokens
        self.stats = SpeculationStats()
        self.rule = SpeculationRule(options.speculative_rule == "measured",
                                    options.speculative_margin, options.speculative_probe_steps)  # fmt: skip

    def finished(self, live: LiveRequest) -> None:
        """A request retired (not preempted): its response drafts for its prompt's others."""
        self.contexts.pop(live.key, None)
        if live.request not in live.sub.aborted:
            self.store.add(live.sub.prompt_of(live.request), live.tokens)

    def drafts(self, rows: list[LiveRequest], budgets: list[int]) -> dict[int, list[int]]:
        """Each row's draft (LiveRequest.key -> tokens), fewer than the tokens it may still
        emit; the indexes of requests no longer decoding are dropped (bounded memory)."""
        drafts = {live.key: self.draft(live, budget - 1) for live, budget in zip(rows, budgets)}
        if len(self.contexts) > len(drafts):
            self.contexts = {key: self.contexts[key] for key in drafts}
        return drafts

    def propose(self, scheduler: SchedulerState) -> tuple[list[list[int]], torch.Tensor | None]:
        """Each row's draft, fewer tokens than it may still emit, and the draft model's q
        [R, K, V] (None for n-gram drafts, which are deterministic)."""
        if self.draft_model is None:
            drafts = self.drafts(scheduler.rows, scheduler.row_budget)
            return [drafts[live.key] for live in scheduler.rows], None
        limits = [min(self.draft_tokens, budget - 1) for budget in scheduler.row_budget]
        return self.draft_model.propose(scheduler, limits)

    def draft(self, live: LiveRequest, limit: int) -> list[int]:
        """Up to min(draft_tokens, limit) tokens to follow the row's tokens read back so far."""
        prompt = live.sub.prompt_of(live.request)
        index = self.contexts.get(live.key)
        if index is None:
            index = self.contexts[live.key] = NgramIndex(self.min_n, self.max_n, prompt)
        index.extend(live.tokens[len(index) - len(prompt) :])
        sources = [*self.store.rollouts(prompt), index]
        return propose(index.tokens, sources, min(self.draft_tokens, limit), self.min_n,
                       self.max_n)  # fmt: skip


def run_step(scheduler: SchedulerState) -> bool:
    """A verify pass instead of a chunk of decode steps, when at most speculative_max_rows
    rows decode, the rule (rule.py) says it pays and some row has a draft. -> whether it ran
    (if not, the caller decodes)."""
    speculation = scheduler.engine.speculation
    if len(scheduler.rows) > speculation.max_rows or not speculation.rule.verify_next():
        return False
    from hybridflow.engine.scheduling import preemption, readback

    flush_started = time.perf_counter()
    readback.flush(scheduler)  # every row's tokens on the host: the drafts extend them
    # timed from here: the flush waits for the decode chunk queued before (tail.py's plain
    # decode time), not for this pass
    started = time.perf_counter()
    speculation.rule.flushed(started - flush_started)
    if scheduler.subs_changed:
        scheduler.sync_submissions()  # the stop ids and sampling mode the pass uses
    drafted = list(scheduler.rows)
    drafts, draft_probs = speculation.propose(scheduler)
    longest = max(map(len, drafts), default=0)
    if not longest:
        return False
    if scheduler.paging is not None and not preemption.make_room(scheduler, longest):
        return False  # every row was preempted
    if len(scheduler.rows) < len(drafted):  # some were preempted: the drafts of the rest
        line = {live.key: row for row, live in enumerate(drafted)}
        kept = [line[live.key] for live in scheduler.rows]
        drafts = [drafts[row] for row in kept]
        if draft_probs is not None:
            draft_probs = draft_probs[torch.as_tensor(kept, device=draft_probs.device)]
    _verify(scheduler, drafts, draft_probs)
    speculation.stats.seconds += time.perf_counter() - started
    return True


def _verify(scheduler: SchedulerState, drafts: list[list[int]],
            draft_probs: torch.Tensor | None = None) -> None:  # fmt: skip
    """One forward over every row's last token and drafts, their acceptance (n-gram drafts
    by the coupling, a draft model's against its q: model_verify.py), the state advanced by
    each row's emitted tokens, and the host's budgets by the same counts."""
    state, rows = scheduler.state, len(scheduler.rows)
    width = max(map(len, drafts)) + 1  # positions per row in the padded [rows, width] views
    drafting = [r for r, draft in enumerate(drafts) if draft]
    slots = [live.slot for live in scheduler.rows]
    saved = rollback.save(scheduler.cache, [slots[r] for r in drafting])  # recurrent states
    if scheduler.static_verify is not None:  # static shapes, a CUDA graph (static_verify.py)
        logits, token_rows, offsets, padded, lengths = _static_forward(scheduler, drafts, width)
    else:
        logits, token_rows, offsets, padded, lengths = _forward(scheduler, drafts, width)
    if draft_probs is None:
        sampled, sampled_logprobs = _sample_positions(scheduler, logits, token_rows, offsets,
                                                      width)  # fmt: skip
        accepted = accepted_lengths(sampled, padded, lengths)
    else:
        sampled, sampled_logprobs, accepted = accept_model_drafts(
            state, logits, token_rows, offsets, padded, lengths, draft_probs
        )
    emitted = emitted_lengths(accepted, state.stop_mask[sampled])
    emitted = torch.where(state.finished[:rows], 0, emitted)
    _advance(state, rows, sampled, sampled_logprobs, emitted)
    accepted_list, emitted_list = torch.stack([accepted, emitted]).tolist()  # the one sync
    if saved is not None:
        _roll_back(scheduler, drafts, emitted_list, drafting, saved)
    scheduler.row_budget[:rows] = [b - e for b, e in zip(scheduler.row_budget, emitted_list)]
    scheduler.decode_steps += 1
    scheduler.decoded_rows += rows
    stats = scheduler.engine.speculation.stats
    stats.passes += 1
    stats.rows += rows
    stats.drafted += sum(map(len, drafts))
    stats.accepted += sum(min(a, e) for a, e in zip(accepted_list, emitted_list))
    stats.emitted += sum(emitted_list)


def _roll_back(scheduler: SchedulerState, drafts, emitted: list[int], drafting: list[int],
               saved: list[torch.Tensor]) -> None:  # fmt: skip
    """Per-sequence kinds of the rows that rejected drafts back to before the pass, then
    through the inputs they kept (rollback.py)."""
    redo = rollback.rows_to_redo(drafts, emitted, drafting)
    if not redo:
        return
    slots = [scheduler.rows[r].slot for r in drafting]
    rollback.restore(scheduler.cache, slots, saved, [drafting.index(r) for r in redo])
    kept = rollback.kept_inputs(drafts, emitted)
    again = [r for r in redo if kept[r] > 0]  # a row that emitted nothing keeps its state
    if again:
        inputs = [drafts[r][: kept[r] - 1] for r in again]
        _forward(scheduler, inputs, max(map(len, inputs)) + 1, [scheduler.rows[r] for r in again])


def _sample_positions(scheduler: SchedulerState, logits, token_rows, offsets, width: int):
    """Every position sampled by the engine's sampler at its sampling step with its row's
    seed (n-gram drafts' coupling: acceptance.py). -> (tokens, log-probs) [rows, width]."""
    state, runner, rows = scheduler.state, scheduler.runner, len(scheduler.rows)
    steps = state.generated[token_rows] + offsets  # the sampling step of each position
    rows_of = token_rows if runner.mixed else None  # each position's row settings
    tokens, logprobs = runner.sample(logits, state.seed_lo[token_rows], state.seed_hi[token_rows],
                                     steps, rows=rows_of)  # fmt: skip
    sampled = torch.zeros((rows, width), dtype=torch.int64, device=tokens.device)
    sampled_logprobs = torch.zeros((rows, width), dtype=logprobs.dtype, device=tokens.device)
    sampled[token_rows, offsets] = tokens
    sampled_logprobs[token_rows, offsets] = logprobs
    return sampled, sampled_logprobs


def _forward(scheduler: SchedulerState, drafts: list[list[int]], width: int,
             lives: list[LiveRequest] | None = None) -> tuple:  # fmt: skip
    """The extend pass over each row's last token and drafts (mixed.run_step's inputs, no
    prompt chunk; lives: these rows instead of the scheduler's). -> (logits [T, V], each
    token's row [T] and index in its row [T], the drafts padded with -1 [rows, width - 1],
    their lengths [rows]), on the device."""
    engine = scheduler.engine
    lives = scheduler.rows if lives is None else lives
    rows = len(lives)
    counts = torch.tensor([len(d) + 1 for d in drafts])
    starts = torch.tensor([len(live.sub.prompt_of(live.request)) + len(live.tokens) - 1
                           for live in lives])  # fmt: skip  # each last token's position
    slots = torch.tensor([live.slot for live in lives])
    ids = torch.tensor([t for live, d in zip(lives, drafts) for t in (live.tokens[-1], *d)])
    offsets = ranges(counts)  # each token's index in its row's pass
    positions = offsets + torch.repeat_interleave(starts, counts)
    token_slots = torch.repeat_interleave(slots, counts)
    token_rows = torch.repeat_interleave(torch.arange(rows), counts)
    padded = _padded(drafts, width)
    triton = engine.decode_backend == "triton"
    spans = host_spans(slots, starts, counts) if triton else ((), ())
    span_tensors = spans[0]
    cache_at = ()
    if scheduler.paging is not None:
        if triton:  # the flash path gathers K/V by (block, offset)
            span_tensors = (*scheduler.paging.locate(*span_tensors[:2]), *span_tensors[2:])
        cache_at = scheduler.paging.locate(token_slots, positions)
    uploaded = upload(engine.device, ids, positions, token_slots, token_rows, offsets, padded,
                      counts - 1, *cache_at, *span_tensors)  # fmt: skip
    ids, positions, token_slots, token_rows, offsets, padded, lengths, *rest = uploaded
    extra = {}
    if cache_at:
        extra["cache_at"], rest = tuple(rest[:2]), rest[2:]
    if triton:
        gather_slots, gather_positions, cu_new, cu_all = rest
        extra["spans"] = (gather_slots, gather_positions, cu_new.to(torch.int32),
                          cu_all.to(torch.int32), *spans[1])  # fmt: skip
    max_len = min(int((starts + counts).max()), scheduler.cache.max_seq_len)
    every = torch.arange(ids.shape[0], device=ids.device)
    logits = engine.extend(engine.model, scheduler.cache, engine.rope, ids, positions,
                           token_slots, every, max_len=max_len, **extra)  # fmt: skip  # [T, V]
    return logits, token_rows, offsets, padded.view(rows, width - 1), lengths


def _padded(drafts: list[list[int]], width: int) -> torch.Tensor:
    """The drafts padded with -1 [rows, width - 1] (CPU)."""
    padded = torch.full((len(drafts), width - 1), -1, dtype=torch.int64)
    for row, draft in enumerate(drafts):
        padded[row, : len(draft)] = torch.tensor(draft, dtype=torch.int64)
    return padded


def _static_forward(scheduler: SchedulerState, drafts: list[list[int]], width: int) -> tuple:
    """_forward's results from the static verify step (static_verify.py): its logits grid
    cut to `width` positions a row, every position of it scored (those past a row's drafts
    are sampled and never read: acceptance stops at a row's length)."""
    grid = scheduler.static_verify.run(scheduler.paging, scheduler.rows, drafts)  # [R, k+1, V]
    rows = len(drafts)
    logits = grid[:, :width].reshape(rows * width, -1)  # [R * width, V]
    device = logits.device
    token_rows = torch.arange(rows, device=device).repeat_interleave(width)
    offsets = torch.arange(width, device=device).repeat(rows)
    lengths = torch.tensor([len(draft) for draft in drafts])
    padded, lengths = upload(scheduler.engine.device, _padded(drafts, width), lengths)
    return logits, token_rows, offsets, padded.view(rows, width - 1), lengths


def _advance(state, rows: int, sampled: torch.Tensor, logprobs: torch.Tensor,
             emitted: torch.Tensor) -> None:  # fmt: skip
    """Record each row's first emitted[r] sampled tokens [rows, W] (and log-probs) in its
    output columns and move it past them (state.advance, several tokens a row). Columns
    past a row's emitted tokens are written to the scratch slot's row instead."""
    width = sampled.shape[1]
    columns = torch.arange(width, device=sampled.device)[None, :]
    valid = columns < emitted[:, None]  # [rows, W]
    slots = state.row_slots[:rows, None].expand(rows, width)
    out_slots = torch.where(valid, slots, state.scratch_slot)
    out_columns = torch.where(valid, state.generated[:rows, None] + columns, 0)
    state.out_tokens[out_slots, out_columns] = sampled
    state.out_logprobs[out_slots, out_columns] = logprobs
    last = sampled.gather(1, (emitted - 1).clamp(min=0)[:, None]).squeeze(1)
    moved = emitted > 0
    state.tokens[:rows] = torch.where(moved, last, state.tokens[:rows])
    state.positions[:rows] += emitted
    state.generated[:rows] += emitted
    stop = state.stop_mask[last] | (state.generated[:rows] >= state.max_new[:rows])
    state.finished[:rows] |= moved & stop


def engine_speculation(engine) -> Speculation | None:
    """An engine's Speculation (make_speculation of its options; None: speculative off, or
    the slow path), refusing graph-captured verify passes its backend cannot run
    (static_verify.graph_verify_problem; the cache kinds are checked with the cache)."""
    options = engine.options
    if options.speculative == "off" or not engine.native:
        return None
    speculation = make_speculation(options, engine.config, engine.device, engine.dtype)
    if options.graph_verify_steps:
        from hybridflow.engine.speculative.static_verify import graph_verify_problem

        problem = graph_verify_problem(engine)
        if problem is not None:
            raise ValueError(problem)
    return speculation


def make_speculation(options: EngineOptions, config, device, dtype) -> Speculation:
    """The engine's Speculation (its draft model loaded on `device` in `dtype` with
    speculative="draft"); ValueError when the draft model cannot draft for the model."""
    draft_model = None
    if options.speculative == "draft":
        from hybridflow.engine.speculative.draft_model import DraftModel

        draft_model = DraftModel.load(options.speculative_draft_model, config, device, dtype)
    return Speculation(options, draft_model)
