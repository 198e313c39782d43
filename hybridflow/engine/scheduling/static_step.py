"""Mixed steps with static shapes, replayed as CUDA graphs (EngineOptions.graph_mixed_steps).

An eager mixed step (mixed.py) launches ~530 kernels from Python: 25-30 ms of host time
against 3-4 ms of GPU work at 0.5b. Here the step's forward (mixed_forward.py), the decode
rows' sampling and their state update read only fixed addresses, so one graph per (decode
rows' batch bucket, token bucket, sampling mode) is captured and replayed:

- the decode rows are the state's first `bucket` rows (graphs.batch_buckets; rows past the
  live ones are finished padding on the scratch slot, as in a decode graph);
- the chunks' tokens are packed from 0 and padded to the smallest of token_buckets(budget)
  that holds them; a padding token sits at offset 0 of the scratch slot or block, the only
  place it writes K/V, which no live sequence reads;
- every input of the chunks (ids, positions, cache entries and offsets, slots, the finished
  jobs' last tokens, the attention's tiles) lives in one device buffer that each step fills
  with one copy from a pinned buffer (two, alternating: a step's copy may still be in flight);
- the logits of the jobs whose last chunk ran go to a buffer outside the graphs' pool, which
  mixed.finish_jobs samples from eagerly (fan-out, first tokens, new rows: host changes).

That machinery (the buffer, the forward of rows beside chunks, the capture) lives in
static_inputs.py, shared with the verify passes of speculative decoding
(speculative/static_verify.py, EngineOptions.graph_verify_steps): there the decode rows are
the rows verified (each its last token), the chunks their drafts (a row with k drafts covers
k + 1 positions; a row with none is a plain decode row of the same step), and the logits of
every position go out instead of the rows being sampled in the graph.

The read-back pipelining is the decode path's: the replay is queued, the scheduler queues
the rows' snapshot after it and reads the previous one while the GPU runs it; nothing here
waits for the GPU. A step with no decode row (a burst of prompts, up to max_prefill_tokens)
runs eagerly: its launches are a small share of its work.

The fused (triton) backend only: engines on the torch backend (hybrid models' recurrent
state, MLA's latent, sink attention's window ring) run their chunks
through the model's own modules, whose extend ops size their work from the data; they keep
the eager mixed step (static_step_for returns None). An FP8 KV cache (cache/fp8_kv.py) is
covered: the forward passes the layer's scales to the stores and to both attentions, which
dequantize each K/V tile as the eager extend pass's kernels do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridflow.engine.kernels.chunk_attention import tile_count, tile_tokens
from hybridflow.engine.scheduling.mixed_forward import static_forward_of
from hybridflow.engine.scheduling.static_inputs import (
    ChunkViews,
    StaticInputs,
    StepGraph,
    capture_step,
    drop_step_graphs,
    static_forward,
)

if TYPE_CHECKING:
    from hybridflow.engine.scheduling.paging import Paging
    from hybridflow.engine.scheduling.view import EngineView, PrefillJob

MAX_CHUNKS = 64  # jobs a static step carries chunks of (the rest wait a step)


def token_buckets(budget: int) -> list[int]:
    """Token counts the chunks are padded to: the budget and quarters of quarters of it (a
    few graphs per batch bucket; a step of a few short turns pads to the smallest)."""
    sizes, size = [], budget
    while size >= 16 and len(sizes) < 3:
        sizes.append(size)
        size //= 4
    return sorted(sizes or [budget])


def static_step_for(engine: EngineView) -> StaticMixedStep | None:
    """The engine's static mixed step, or None where its steps stay eager (module docstring)."""
    forward = static_forward_of(engine.extend)
    cache = engine.cache
    if forward is None or cache.per_sequence or cache.latent is not None:
        return None
    return StaticMixedStep(engine, forward)


class StaticMixedStep:
    def __init__(self, engine: EngineView, forward):
        self.engine, self.forward = engine, forward
        self.cache, self.runner = engine.cache, engine.runner
        drop_step_graphs(self.runner, "mixed")  # captured over an earlier step's buffers
        budget = engine.options.max_prefill_tokens_per_step
        self.buckets = token_buckets(budget)
        self.max_chunks = min(MAX_CHUNKS, self.cache.num_slots, budget)
        config = engine.config
        per_tile = tile_tokens(config.num_attention_heads, config.num_key_value_heads)
        tiles = {t: tile_count(t, self.max_chunks, per_tile) for t in self.buckets}
        # the keep field: the finished jobs' last tokens (their index among the chunks')
        self.inputs = StaticInputs(engine, tiles, self.max_chunks, per_tile)
        self.arange = torch.arange(engine.state.capacity, device=engine.device)
        self.job_logits = torch.empty(self.max_chunks, config.vocab_size, device=engine.device,
                                      dtype=engine.model.lm_head.weight.dtype)  # fmt: skip
        self.captures = 0  # graphs captured so far (a counter)
        self.steps = 0  # static steps run (a counter)
        self.shape = (0, 0)  # the last step's (batch bucket, token bucket)

    # -- host side ------------------------------------------------------------------------------

    def bucket(self, rows: int) -> int:
        return next(b for b in self.runner.buckets if b >= rows)

    def run(self, paging: Paging | None, rows: int,
            chunks: list[tuple[PrefillJob, int, int]], finished: list[int]) -> torch.Tensor:  # fmt: skip
        """One step: rows [0, rows) decode (sampled and advanced on the device) beside the
        chunks (job, first position, count); -> the logits of the `finished` chunks' last
        tokens [len(finished), V] (a view of job_logits, valid until the next step)."""
        counts = [count for _, _, count in chunks]
        tokens = next(t for t in self.buckets if t >= sum(counts))
        bucket = self.bucket(rows)
        self._upload(paging, chunks, finished, tokens)
        self.shape = (bucket, tokens)
        if paging is not None:
            paging.sync_table()  # the rows' and chunks' blocks, before any read
        if self.runner.use_graphs:
            self._graph(bucket, tokens).replay()
        else:
            self._step(bucket, tokens)
        self.steps += 1
        return self.job_logits[: len(finished)]

    def capture_all(self) -> int:
        """Capture the current sampling mode's graph of every (batch bucket, token bucket)
        now, not at first use (Engine.warm_up; idle engines: the warm-up steps run padding
        rows and tokens only, on the scratch slot and block). -> how many were new."""
        if not self.runner.use_graphs or self.engine.state.num_rows:
            return 0
        before = self.captures
        for tokens in self.buckets:
            self._upload(None, [], [], tokens)
            for bucket in self.runner.buckets:
                self._graph(bucket, tokens)
        return self.captures - before

    def _upload(self, paging, chunks, finished, tokens: int) -> None:
        """The chunks' inputs, padded to `tokens`, into the device buffer (one copy);
        paging: the scheduler's (paging.py), None for a slot cache."""
        as_array = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
        counts = as_array([count for _, _, count in chunks])
        ends = (np.cumsum(counts) - 1)[finished]  # the finished jobs' last tokens
        ids = [t for job, start, n in chunks for t in job.sequence[start : start + n]]
        self.inputs.fill(paging, as_array([job.slots[0] for job, _, _ in chunks]),
                         as_array([start for _, start, _ in chunks]), counts, ids, ends,
                         tokens)  # fmt: skip

    def _views(self, tokens: int) -> ChunkViews:
        return self.inputs.views(tokens)

    # -- the step (eager, or what a graph captures) ---------------------------------------------

    def _step(self, bucket: int, tokens: int) -> None:
        views = self._views(tokens)
        keep = torch.cat([self.arange[:bucket], views.keep + bucket])
        logits = static_forward(self.engine, self.forward, bucket, views, keep)
        # [bucket + max_chunks, V]
        self.runner.sample_and_advance(logits[:bucket], bucket)
        self.job_logits.copy_(logits[bucket:])

    def _graph(self, bucket: int, tokens: int) -> StepGraph:
        runner = self.runner
        key = (("mixed", bucket, tokens), (runner.params.mode_key(), runner.shared))
        graph = runner.graphs.get(key)
        if graph is None:
            step = lambda: self._step(bucket, tokens)  # noqa: E731
            graph = runner.graphs[key] = capture_step(runner, self.engine.state, step)
            self.captures += 1
        return graph
