"""Decode steps, eager or replayed as CUDA graphs captured per bucketed batch size.

A step = forward one token per row + sample + advance the device state. Everything it reads
(tokens, positions, slots, seeds, stop mask, weights, cache) lives at fixed addresses, so the
step is captured once per (bucket, sampling mode) and replayed; the weights are read where the
trainer keeps them, so in-place optimizer updates need no recapture (a changed parameter
address does: checked whenever generation starts). A batch whose rows share one sampling
setting runs the sampler specialised for it; rows that differ run row_sampling.py's.
"""

from __future__ import annotations

import torch

from hybridflow.engine.kernels.launch import PLAIN, Launch
from hybridflow.engine.row_sampling import RowMixedMode, sample_rows
from hybridflow.engine.sampling import SamplingParams, sample_reference
from hybridflow.engine.state import DecodeState, advance


def batch_buckets(max_rows: int) -> list[int]:
    """Captured batch sizes: powers of two to 16, then steps of 16 to 128, 32 to 512, 64 on."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        step = 16 if size >= 16 else size
        step = 32 if size >= 128 else step
        step = 64 if size >= 512 else step
        size += step
    sizes.append(max_rows)
    return sorted(set(sizes))


class DecodeRunner:
    def __init__(
        self,
        model,
        cache,
        state: DecodeState,
        rope,
        decode_forward,
        use_graphs: bool,
        use_triton_sampler: bool,
        launch: Launch = PLAIN,
    ):
        self.model, self.cache, self.state, self.rope = model, cache, state, rope
        self.decode_forward = decode_forward
        self.use_graphs = use_graphs
        self.use_triton_sampler = use_triton_sampler
        self.launch = launch  # the fused sampler's (kernels/launch.py)
        self.buckets = batch_buckets(state.capacity)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.params: SamplingParams | RowMixedMode | None = None
        self._weights_key = None
        self._recent_modes: list[tuple] = []
        self.shared = False  # shared_prefix attention of the steps (set_mode)
        self.captures = 0  # graphs captured so far (a counter: each costs a warm-up and timing)

    # -- sampling ----------------------------------------------------------------------------

    def sample(self, logits, seed_lo, seed_hi, steps, params=None, rows=None):
        """logits [B, V] -> (tokens [B] int64, logprobs [B] fp32), no host sync. params: the
        rows' one SamplingParams; or a RowMixedMode with `rows`, the state's row slice whose
        settings apply (rows just appended)."""
        params = self.params if params is None else params
        if isinstance(params, RowMixedMode):
            state = self.state
            return sample_rows(logits, state.temperature[rows], state.top_k[rows],
                               state.top_p[rows], state.min_p[rows], seed_lo, seed_hi, steps,
                               params)  # fmt: skip
        if self.use_triton_sampler:
            from hybridflow.engine.kernels.sampler import sample_fused

            return sample_fused(logits, params, seed_lo, seed_hi, steps, launch=self.launch)
        return sample_reference(logits, params, seed_lo, seed_hi, steps)

    # -- steps -------------------------------------------------------------------------------

    def check_weights(self) -> None:
        """Drop every graph if a parameter moved (new storage): graphs read weights at the
        addresses they were captured with. Called when generation (re)starts."""
        key = tuple(p.data_ptr() for p in self.model.parameters())
        if key != self._weights_key:
            self.graphs.clear()
            self._weights_key = key

    def set_mode(self, mode, shared: bool = False) -> None:
        """The sampling mode of the next steps: a SamplingParams every live row shares (its
        fused, specialised sampler) or a RowMixedMode (each row's settings from the state:
        row_sampling.py). Graphs of modes other than the last few used are dropped.
        shared: decode attention reads each prompt's prefix once per group of its samples
        (shared_prefix.py; the scheduler keeps the state's group table current)."""
        self.params = mode
        self.shared = shared
        key = (mode.mode_key(), shared)
        if self._recent_modes and self._recent_modes[0] == key:
            return
        self._recent_modes = [key] + [m for m in self._recent_modes if m != key][:3]
        for graph_key in [k for k in self.graphs if k[1] not in self._recent_modes]:
            del self.graphs[graph_key]

    @property
    def mixed(self) -> bool:
        return isinstance(self.params, RowMixedMode)

    def _step(self, rows: int, max_len: int) -> None:
        state = self.state
        extra = {}
        if self.shared:
            extra["shared"] = (state.prefix_first[:rows], state.prefix_groups)
        if self.cache.per_sequence:  # finished rows keep their state (or window ring)
            extra["frozen"] = state.finished[:rows]
        logits = self.decode_forward(
            self.model, self.cache, self.rope, state.tokens[:rows], state.positions[:rows],
            state.row_slots[:rows], max_len, **extra,
        )  # fmt: skip
        self.sample_and_advance(logits, rows)

    def sample_and_advance(self, logits: torch.Tensor, rows: int) -> None:
        """advance_rows as a captured step runs it: with the fused sampler and one sampling
        setting, sampling and the state update in the same kernels (one launch less per op)."""
        if self.use_triton_sampler and not self.mixed:
            from hybridflow.engine.kernels.sampler import sample_fused

            state = self.state
            sample_fused(logits, self.params, state.seed_lo, state.seed_hi, state.generated,
                         state=state, launch=self.launch)  # fmt: skip
            return
        self.advance_rows(logits, rows)

    def advance_rows(self, logits: torch.Tensor, rows: int) -> None:
        """Sample rows [0, rows)' next tokens from their logits [rows, V] and advance the state
        (what a decode step does after its forward; a mixed step's forward is the
        scheduler's), no host sync."""
        state = self.state
        if self.mixed:
            tokens, logprobs = sample_rows(
                logits, state.temperature[:rows], state.top_k[:rows], state.top_p[:rows],
                state.min_p[:rows], state.seed_lo[:rows], state.seed_hi[:rows],
                state.generated[:rows], self.params,
            )  # fmt: skip
        else:
            tokens, logprobs = self.sample(
                logits, state.seed_lo[:rows], state.seed_hi[:rows], state.generated[:rows]
            )
        advance(state, rows, tokens, logprobs)

    def decode_steps(self, num_rows: int, steps: int, max_live_len: int) -> None:
        """Advance rows [0, num_rows) by `steps` tokens (finished rows stay put)."""
        bucket = next(b for b in self.buckets if b >= num_rows)
        if not self.use_graphs:
            for _ in range(steps):
                self._step(num_rows, min(max_live_len, self.cache.max_seq_len))
            return
        graph = self._graph(bucket)
        # One launch per step: a chunk captured as one 8-step graph measured no faster (H200,
        # 0.5b: 3,202 vs 3,119 us per step at 1024 rows; 168.6k vs 169.8k tok/s at 256).
        for _ in range(steps):
            graph.replay()

    def capture_all(self) -> int:
        """Capture the current mode's graph of every batch-size bucket now (with the timing
        choices each makes), not at first use; -> how many were new."""
        if not self.use_graphs or self.state.num_rows:
            return 0
        before = self.captures
        # The rows are padding (the scratch slot): at position 0 the warm-up would tune the
        # attention tiles for one cached token. Half the cache is what a call averages.
        positions = self.state.positions.clone()
        self.state.positions.fill_(self.cache.max_seq_len // 2)
        try:
            for bucket in self.buckets:
                self._graph(bucket)
        finally:
            self.state.positions.copy_(positions)
        return self.captures - before

    def _graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        key = (bucket, (self.params.mode_key(), self.shared))
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        max_len = self.cache.max_seq_len
        # Warm-up (kernel compilation, cuBLAS workspaces) runs the step for real: snapshot the
        # row state and restore it after, so the live rows redo exactly the same step later.
        # (Their output writes are overwritten by that step; the cache writes, at the middle
        # positions, by the step that reaches them, before any step reads them.)
        snapshot = [f.clone() for f in self.state._row_fields]
        # Warm up (and so tune the attention tile, the matmul tiles and the decode layer) with
        # each row moved halfway through what it may still generate, not at its first step: a
        # call's attention time is spent mostly at longer lengths, and the tile that wins at
        # 129 cached positions is not the one that wins a call (H200: 0.5b/1024's best at 130
        # was 2-3% slower at 256 and 380).
        self.state.move_to_middle(bucket, max_len)
        if self.cache.per_sequence:
            # a recurrent state moves with every step, not only at its position: the warm-up
            # steps' rows write the scratch slot, so the live rows' states stay as they were
            self.state.row_slots[:bucket] = self.state.scratch_slot
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(bucket, max_len)
        torch.cuda.current_stream().wait_stream(stream)
        for field, saved in zip(self.state._row_fields, snapshot):
            field.copy_(saved)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of the process (a trainer beside the rollout service)
        # may allocate or synchronize while this one captures; "global" would fail its calls
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._step(bucket, max_len)
        self.graphs[key] = graph
        self.captures += 1
        return graph
