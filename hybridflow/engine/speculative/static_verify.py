"""Verify passes with static shapes, replayed as CUDA graphs (EngineOptions.graph_verify_steps).

A verify pass (verify.py) is a decode step whose rows carry their drafts: row r feeds its
last token at its position p_r and its drafts d_1..d_m at p_r + 1..p_r + m, and the logits
of all m + 1 positions are read. So it runs as a static mixed step (scheduling/
static_step.py, static_inputs.py) whose decode rows are the rows verified and whose chunks
are their drafts:

- the rows are the state's first `bucket` rows (graphs.batch_buckets, up to the bucket that
  holds speculative_max_rows; rows past the live ones are finished padding on the scratch
  slot), each one token at its position through the decode attention: a row with no draft
  is an ordinary decode row of the same step;
- a row's drafts are a chunk of its slot from p_r + 1, packed from 0 with the other rows',
  padded to bucket x speculative_draft_tokens tokens (one token bucket per batch bucket:
  no pass has more); the padding writes its K/V at offset 0 of the scratch entry only. A
  draft attends through the block table over its row's cache up to its own position: the
  row's token and earlier drafts are stored before any attention of the layer reads;
- the keep field maps each (row, offset) of the [bucket, k + 1] grid to its token (offset 0
  the row's, offset j its j-th draft's; offsets past a row's drafts its row's again: finite
  logits that no acceptance reads), so the logits come out [bucket * (k + 1), V] into a
  buffer outside the graphs' pool.

After the replay the pass goes on eagerly, as after the eager forward: every position
sampled, the drafts accepted (n-gram drafts by the coupling, a draft model's against its q),
the rows advanced, the counts read back. The K/V of rejected drafts lie past their row's
end, as in the eager pass (rolled back by the row's length alone: verify.py). One graph per
batch bucket (and sampling mode, as every graph in the runner's table).

The fused (triton) backend over K/V caches only, in the model's dtype or FP8 (the static
forward passes an FP8 cache's scales to every kernel, as the eager extend pass): a recurrent
state or a sliding window's ring is rolled back by copies (rollback.py), a latent (MLA)
cache runs the model's own modules; graph_verify_steps on such an engine is refused
(graph_verify_problem).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridflow.engine.kernels.chunk_attention import tile_count, tile_tokens
from hybridflow.engine.scheduling.mixed_forward import static_forward_of
from hybridflow.engine.scheduling.static_inputs import (
    StaticInputs,
    StepGraph,
    capture_step,
    drop_step_graphs,
    static_forward,
)

if TYPE_CHECKING:
    from hybridflow.engine.requests import LiveRequest
    from hybridflow.engine.scheduling.paging import Paging
    from hybridflow.engine.scheduling.view import EngineView

KEY = "graph_verify_steps"


def graph_verify_problem(engine: EngineView) -> str | None:
    """Why the engine's verify passes cannot run with static shapes, as a refusal naming
    the key (None: they can). Before the cache exists, its kinds are not checked (Engine
    checks the backend when made, the scheduler the cache's kinds)."""
    if engine.decode_backend != "triton":
        return (f"{KEY}=true runs verify passes on the fused (triton) backend; this engine "
                "runs the torch backend (decode_backend=torch, or a model with recurrent, "
                f"latent or sink-window layers): set {KEY}=false")  # fmt: skip
    cache = engine.cache
    if cache is None:
        return None
    kinds = [name for name, present in (
        ("recurrent or sliding-window state", cache.per_sequence),
        ("latent (MLA) cache", cache.latent is not None),
        ("extend pass other than the fused one", static_forward_of(engine.extend) is None),
    ) if present]  # fmt: skip
    if kinds:
        return (f"{KEY}=true covers full-attention K/V caches on the fused backend; "
                f"this engine has a {' and a '.join(kinds)}: set {KEY}=false")  # fmt: skip
    return None


def static_verify_for(engine: EngineView) -> StaticVerifyStep:
    """The engine's static verify step; ValueError naming the key where it has none."""
    problem = graph_verify_problem(engine)
    if problem is not None:
        raise ValueError(problem)
    return StaticVerifyStep(engine, static_forward_of(engine.extend))


def keep_grid(counts: np.ndarray, bucket: int, width: int) -> np.ndarray:
    """The forward's token of each (row, offset) of a [bucket, width] grid, flattened
    [bucket * width]: rows are tokens [0, bucket), row r's drafts (counts[r] of them,
    packed after the rows in row order) follow from token bucket + sum(counts[:r]);
    offset 0 and the offsets past a row's drafts index the row itself."""
    grid = np.repeat(np.arange(bucket, dtype=np.int64), width).reshape(bucket, width)
    rows = len(counts)
    offsets = np.arange(1, width)[None, :]  # [1, width - 1]
    drafted = offsets <= counts[:, None]  # [rows, width - 1]
    firsts = bucket + np.cumsum(counts) - counts
    grid[:rows, 1:] = np.where(drafted, firsts[:, None] + offsets - 1, grid[:rows, 1:])
    return grid.reshape(-1)


class StaticVerifyStep:
    def __init__(self, engine: EngineView, forward):
        self.engine, self.forward = engine, forward
        self.runner = engine.runner
        drop_step_graphs(self.runner, "verify")  # captured over an earlier step's buffers
        options = engine.options
        self.drafts = options.speculative_draft_tokens  # k: draft tokens a row at most
        self.width = self.drafts + 1
        rows = min(options.speculative_max_rows, engine.state.capacity)
        top = next(b for b in self.runner.buckets if b >= rows)
        self.buckets = [b for b in self.runner.buckets if b <= top]
        config = engine.config
        per_tile = tile_tokens(config.num_attention_heads, config.num_key_value_heads)
        tiles = {b * self.drafts: tile_count(b * self.drafts, b, per_tile) for b in self.buckets}
        self.inputs = StaticInputs(engine, tiles, top * self.width, per_tile)
        self.logits = torch.empty(top * self.width, config.vocab_size, device=engine.device,
                                  dtype=engine.model.lm_head.weight.dtype)  # fmt: skip
        self.captures = 0  # graphs captured so far (a counter)
        self.steps = 0  # static verify passes run (a counter)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(self, paging: Paging | None, lives: list[LiveRequest],
            drafts: list[list[int]]) -> torch.Tensor:  # fmt: skip
        """One forward of the state's rows [0, len(lives)) (lives: their requests, tokens
        read back) and their drafts (each at most speculative_draft_tokens) -> logits
        [rows, k + 1, V]: offset 0 after the row's last token, offset j after its j-th
        draft (a view of self.logits, valid until the next pass)."""
        bucket = self.bucket(len(lives))
        self._upload(paging, lives, drafts, bucket)
        if paging is not None:
            paging.sync_table()  # the drafts' blocks, before any read
        if self.runner.use_graphs:
            self._graph(bucket).replay()
        else:
            self._step(bucket)
        self.steps += 1
        return self.logits[: bucket * self.width].view(bucket, self.width, -1)[: len(lives)]

    def capture_all(self) -> int:
        """Capture the current sampling mode's graph of every batch bucket now (Engine.warm_up;
        idle engines: padding rows and tokens only). -> how many were new."""
        if not self.runner.use_graphs or self.engine.state.num_rows:
            return 0
        before = self.captures
        for bucket in self.buckets:
            self._upload(None, [], [], bucket)
            self._graph(bucket)
        return self.captures - before

    def _upload(self, paging, lives, drafts, bucket: int) -> None:
        counts = np.array([len(draft) for draft in drafts], dtype=np.int64)
        # each row's first draft goes right after its last token
        starts = np.array([len(live.sub.prompt_of(live.request)) + len(live.tokens)
                           for live in lives], dtype=np.int64)  # fmt: skip
        slots = np.array([live.slot for live in lives], dtype=np.int64)
        ids = [token for draft in drafts for token in draft]
        keep = keep_grid(counts, bucket, self.width)
        self.inputs.fill(paging, slots, starts, counts, ids, keep, bucket * self.drafts)

    def _step(self, bucket: int) -> None:
        views = self.inputs.views(bucket * self.drafts)
        size = bucket * self.width
        logits = static_forward(self.engine, self.forward, bucket, views, views.keep[:size],
                                rotate_chunks=True)  # fmt: skip  # [bucket * (k + 1), V]
        self.logits[:size].copy_(logits)

    def _graph(self, bucket: int) -> StepGraph:
        runner = self.runner
        key = (("verify", bucket), (runner.params.mode_key(), runner.shared))
        graph = runner.graphs.get(key)
        if graph is None:
            step = lambda: self._step(bucket)  # noqa: E731
            graph = runner.graphs[key] = capture_step(runner, self.engine.state, step)
            self.captures += 1
        return graph
