"""Engine: token ids in, token ids + log-probs out, with continuous batching.

    engine = Engine(model, max_batch_size=256, max_seq_len=1024)
    completions = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=256, seed=0))
    engine.release()  # KV cache freed; the next generate() allocates it again

Loop: admit waiting requests into free slots (packed prefill of each unique prompt once, KV
copied to its n sample slots, first tokens sampled), queue `steps_per_sync` decode steps on
the device (CUDA-graph replays, no host sync) and a copy of the rows' finished flags and new
tokens; then read the copy of the chunk before (SYNC_LAG): append its tokens to the
requests' lists, retire finished rows and free their slots for the next admission. The GPU
runs the queued chunk while the host does that.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from hybridflow.engine import kv_cache
from hybridflow.engine.forward import (
    DECODE_FORWARDS,
    FusedProjections,
    RopeTable,
    prefill_forward,
    prefill_forward_triton,
)
from hybridflow.engine.graphs import DecodeRunner
from hybridflow.engine.sampling import SamplingParams, request_seeds, split_seed
from hybridflow.engine.state import DecodeState


@dataclass
class Completion:
    token_ids: list[int]
    """Generated tokens; a stop token that ended the sample is included."""
    logprobs: list[float]
    """log_softmax(logits / T) at each token, before top-k/top-p/min-p (T = 1 when greedy)."""
    finish_reason: str
    """'stop' (a stop token was emitted) or 'length' (max_new_tokens or max_seq_len reached)."""


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class Engine:
    """Generation engine over a hybridflow CausalLM's parameters (in place, no copy).

    Args:
        model: hybridflow.models.CausalLM. Anything else with forward(input_ids,
            attention_mask) -> logits and a .config with vocab_size/eos_token_id (the
            transformers fallback, models/hf_fallback.py) runs the slow path (slow.py).
        max_batch_size: sequences decoded together (KV-cache slots).
        max_seq_len: prompt + generated tokens per sequence.
        memory_budget: KV-cache bytes (int), fraction of free device memory (float in (0, 1]),
            or None (all of max_batch_size if it fits in 90% of free memory).
        decode_backend: "auto" (triton on CUDA when importable, else torch), "triton", "torch".
        cuda_graphs: replay decode steps as CUDA graphs (default: on for CUDA).
        steps_per_sync: decode steps between two host checks for finished sequences (8 was
            fastest of 8/16/32/64 on an H200, docs/PERFORMANCE.md). The host reads each
            chunk's flags one chunk late (SYNC_LAG), so a finished row's slot is refilled up
            to two chunks after it finished.
        max_prefill_tokens: prompt tokens per packed prefill pass (bounds activation memory).
        fuse_projections: triton backend: "all" (default) keeps a concatenated copy of each
            layer's q/k/v and gate/up weights (one matmul instead of three, one instead of two;
            the copy is ~70% of the non-embedding weights, refreshed from the parameters at
            every generate(), freed by release(), outside memory_budget); "qkv" copies q/k/v
            only (~10%); "none" reads every weight in place. Measured on an H200, 0.5B, 256
            prompts: all 128k, qkv 122k, none 113k tok/s (docs/PERFORMANCE.md).
        decode_matmul: triton backend: "auto" (default) times, once per shape, cuBLAS +
            the silu_mul kernel against a Triton matmul with SiLU*up in its epilogue for the
            MLP's gate/up projection, and keeps the faster (gemm.DecodeMatmul; the other
            matmuls are cuBLAS: it won every other decode shape). "cublas" never uses Triton;
            "triton" always does for gate/up. H200, 256 prompts: auto 150k vs cublas 140k
            tok/s on 0.5b (Triton chosen), equal on 1.5b (cuBLAS chosen; NOTES.md, run 5).
        fuse_norms: triton backend with fuse_projections="all", decode batches up to 1024
            rows: the five-launch decode layer (chain.py: RMSNorms and residual adds inside
            the matmuls) instead of the eight-launch one. "auto" (default): times both, once
            per batch-size bucket (~4 s of warm-up), keeps the chain only when its forward is
            2% faster; "on": always; "off": never. With programmatic dependent launch (pdl.py;
            the chain is all Triton, so every launch overlaps the previous one) the chain won
            at 0.5b/256 on the H200: 167k vs 153k tok/s; the split path wins at 1024 rows and
            on 1.5b, where "auto" keeps it (NOTES.md, run 8).
    """

    def __init__(
        self,
        model,
        max_batch_size: int = 256,
        max_seq_len: int = 2048,
        memory_budget: int | float | None = None,
        *,
        decode_backend: str = "auto",
        cuda_graphs: bool | None = None,
        steps_per_sync: int = 8,
        max_prefill_tokens: int = 16384,
        fuse_projections: str = "all",
        decode_matmul: str = "auto",
        fuse_norms: str = "auto",
    ):
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        window = getattr(self.config, "sliding_window", None)
        if window is not None and max_seq_len > window:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds sliding_window={window}: the engine attends "
                "to the full prefix (like the model), so lower max_seq_len to the window"
            )
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.memory_budget = memory_budget
        self.steps_per_sync = steps_per_sync
        self.max_prefill_tokens = max_prefill_tokens
        from hybridflow.models.llama import CausalLM

        self.native = isinstance(model, CausalLM)  # else: slow path (slow.py)
        if decode_backend == "auto":
            use_triton = self.device.type == "cuda" and _triton_available()
            decode_backend = "triton" if use_triton else "torch"
        if decode_backend not in DECODE_FORWARDS:
            raise ValueError(f"decode_backend={decode_backend!r} not in {sorted(DECODE_FORWARDS)}")
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # kernel tests on CPU
        if decode_backend == "triton" and self.device.type != "cuda" and not interpreted:
            raise ValueError("decode_backend='triton' needs the model on a CUDA device")
        if fuse_projections not in ("none", "qkv", "all"):
            raise ValueError(f"fuse_projections={fuse_projections!r} not in none/qkv/all")
        self.fuse_projections = fuse_projections if decode_backend == "triton" else "none"
        self.fused = None
        self.matmul = self.chain = None
        if decode_backend == "triton":
            from hybridflow.engine.chain import DecodeChain
            from hybridflow.engine.gemm import DecodeMatmul

            # kept across release(): shape choices
            self.matmul = DecodeMatmul(decode_matmul)
            self.chain = DecodeChain(fuse_norms)
        self.decode_backend = decode_backend
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.cache: kv_cache.KVCache | None = None
        self.state: DecodeState | None = None
        self.runner: DecodeRunner | None = None
        self.rope = None
        self.prefill = prefill_forward

    # -- memory ---------------------------------------------------------------------------------

    def _allocate(self) -> None:
        cfg = self.config
        if self.decode_backend == "triton" and self.fuse_projections != "none":
            # Before the cache: a budget given as a fraction of free memory must see it used.
            self.fused = FusedProjections(self.model, gate_up=self.fuse_projections == "all")
        slot_bytes = kv_cache.bytes_per_slot(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, self.max_seq_len,
            self.dtype,
        )  # fmt: skip
        # Reserve for decode logits and prefill activations, which live outside the cache.
        element = torch.empty((), dtype=self.dtype).element_size()
        reserve = (self.max_batch_size * cfg.vocab_size * 6) + self.max_prefill_tokens * (
            4 * cfg.intermediate_size + 8 * cfg.hidden_size
        ) * element
        slots = kv_cache.plan_slots(
            self.max_batch_size, slot_bytes, self.memory_budget, self.device, reserve
        )
        self.cache = kv_cache.allocate_cache(
            cfg.num_hidden_layers, slots, self.max_seq_len, cfg.num_key_value_heads,
            cfg.head_dim, self.dtype, self.device,
        )  # fmt: skip
        self.state = DecodeState(slots, slots, self.max_seq_len, cfg.vocab_size, self.device)
        self.rope = RopeTable(cfg, self.max_seq_len, self.dtype, self.device)
        decode_forward = DECODE_FORWARDS[self.decode_backend]
        self.prefill = prefill_forward
        if self.decode_backend == "triton":
            kw = dict(fused=self.fused, matmul=self.matmul)
            decode_forward = functools.partial(decode_forward, chain=self.chain, **kw)
            self.prefill = functools.partial(prefill_forward_triton, **kw)
        self.runner = DecodeRunner(
            self.model, self.cache, self.state, self.rope, decode_forward,
            use_graphs=self.cuda_graphs, use_triton_sampler=self.decode_backend == "triton",
        )  # fmt: skip

    def release(self) -> None:
        """Free the KV cache, decode state and captured graphs (memory back to training)."""
        self.cache = self.state = self.runner = self.rope = self.fused = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def num_slots(self) -> int:
        if self.cache is None:
            self._allocate()
        return self.cache.num_slots

    @torch.no_grad()
    def load_weights(self, named_tensors, bucket_bytes: int = 256 * 2**20) -> None:
        """Copy (name, tensor) pairs (HF names) into the model's parameters, in buckets of about
        bucket_bytes (one device sync per bucket bounds the staging memory)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        pending = 0
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"load_weights: {name!r} is not a parameter of the model")
            target = params[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"model expects {tuple(target.shape)}"
                )
            target.data.copy_(tensor, non_blocking=True)
            pending += tensor.numel() * tensor.element_size()
            if pending >= bucket_bytes and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                pending = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- generation -----------------------------------------------------------------------------

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        stop = list(params.stop_token_ids)
        eos = self.config.eos_token_id
        if not params.ignore_eos and eos is not None:
            stop += list(eos) if isinstance(eos, (list, tuple)) else [eos]
        return sorted(set(stop))

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        """Raise ValueError naming the first bad prompt. Vectorised: it runs before the first
        prefill kernel with the GPU idle (1024 prompts x 128 tokens: 2.2 ms, against 3.8 ms
        for per-prompt min/max on the CPU machine)."""
        lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
        if (lengths == 0).any():
            raise ValueError(f"prompt {int(np.argmax(lengths == 0))} is empty")
        if (lengths >= self.max_seq_len).any():
            i = int(np.argmax(lengths >= self.max_seq_len))
            raise ValueError(
                f"prompt {i} has {lengths[i]} tokens; max_seq_len={self.max_seq_len} "
                "leaves no room to generate: raise max_seq_len"
            )
        vocab = self.config.vocab_size
        flat = _flat_int64(prompts).numpy()
        bad = (flat < 0) | (flat >= vocab)
        if bad.any():
            i = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(bad)), side="right"))
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """n completions per prompt, prompt-major: result[i * n + j] is sample j of prompt i."""
        return [Completion(*result) for result in self._generate(prompts, params)]

    @torch.no_grad()
    def _generate(self, prompts, params: SamplingParams) -> list[tuple]:
        """generate() as (token_ids list, logprobs list, finish_reason) tuples."""
        if not self.native:
            from hybridflow.engine.slow import generate_slow

            return [
                (c.token_ids, c.logprobs, c.finish_reason)
                for c in generate_slow(self, prompts, params)
            ]
        if self.fused is not None:
            # Weights may have changed since the last call. Queued first: the GPU copies while
            # the host checks the prompts and builds the first prefill's inputs.
            self.fused.refresh(self.model)
        self._check_prompts(prompts)
        if self.cache is None:
            self._allocate()  # makes (and fills) the fused copies
        base_seed = params.seed
        if base_seed is None:
            base_seed = int(torch.randint(0, 2**62, (1,)).item())
        seed_lo, seed_hi = split_seed(request_seeds(base_seed, len(prompts), params.n))
        self.state.set_stop_tokens(self._stop_ids(params))
        self.runner.prepare(params)
        loop = _GenerationLoop(self, prompts, params, seed_lo.tolist(), seed_hi.tolist())
        with _cyclic_gc_paused():
            if self.device.type != "cuda":
                return loop.run()
            with torch.cuda.device(self.device):  # graphs and side streams on the model's GPU
                return loop.run()

    def generate_padded(
        self, prompts: list[list[int]], params: SamplingParams, pad_token_id: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Tensors for the trainer, prompt-major rows [B * n]: responses [B*n, R] int64
        right-padded with pad_token_id, rollout_logprobs [B*n, R] fp32 (0 on padding),
        response_lengths [B*n] int64; R = longest response. On CPU."""
        results = self._generate(prompts, params)
        if pad_token_id is None:
            pad_token_id = self.config.pad_token_id or 0
        lengths = [len(tokens) for tokens, _, _ in results]
        width = max(lengths, default=0)
        responses = torch.tensor(
            [tokens + [pad_token_id] * (width - len(tokens)) for tokens, _, _ in results],
            dtype=torch.int64,
        ).reshape(len(results), width)
        logprobs = torch.tensor(
            [lp + [0.0] * (width - len(lp)) for _, lp, _ in results], dtype=torch.float32
        ).reshape(len(results), width)
        return {"responses": responses, "rollout_logprobs": logprobs,
                "response_lengths": torch.tensor(lengths, dtype=torch.int64)}  # fmt: skip


# Host reads of the decode state lag the device by one chunk of steps: the next chunk's
# replays are queued before the host waits for the previous chunk's finished flags and new
# tokens, so the GPU does not idle while the host compacts rows, admits prompts and turns
# tokens into lists. H200, 0.5b (docs/PERFORMANCE.md, session 6): 171k vs 162k tok/s at 256
# rows, 242k vs 227k at 1024; with a queue and early stops (1024 prompts through 256 slots),
# where a slot is refilled one chunk later, still 93.6k vs 74.4k. None: 1 on CUDA, 0 on CPU
# (nothing runs while the host reads there, so lagging only keeps finished rows in the batch
# one chunk longer); 0 or 1 force it (tests, A/B runs).
SYNC_LAG: int | None = None


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


class _GenerationLoop:
    """Host-side bookkeeping of one generate() call: requests, slots, rows, results."""

    def __init__(self, engine: Engine, prompts, params: SamplingParams, seed_lo, seed_hi):
        self.engine, self.prompts, self.params = engine, prompts, params
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
        self.free_slots = list(range(self.cache.num_slots - 1, -1, -1))
        self.row_request: list[int] = []  # request id of each live row
        self.row_slot: list[int] = []  # its cache slot
        self.row_budget: list[int] = []  # upper bound on steps each row may still take
        self.row_end: list[int] = []  # prompt length + max_new: bound on the row's cache length
        # tokens and log-probs read back so far, per live request
        self.partial: dict[int, tuple[list[int], list[float]]] = {}
        # (token_ids, logprobs, finish_reason) per request
        self.results: list[tuple | None] = [None] * len(self.max_new)
        # output columns a snapshot reads per row: a chunk's steps + the admission's token
        self.window = engine.steps_per_sync + 1
        self.columns = torch.arange(self.window, device=engine.device)
        self.lagged = engine.device.type == "cuda" if SYNC_LAG is None else SYNC_LAG > 0

    def run(self) -> list[tuple]:
        pending = None
        while self.waiting or self.row_request or pending is not None:
            # Admit until the slots or the queue run out (several prefill passes back to back):
            # rows admitted later would otherwise trail the first ones by a whole chunk of
            # steps at a smaller batch (an H200 profile of 256 prompts showed 15 steps at 128 rows).
            while self.waiting and self._should_admit():
                self._admit()
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
            prompt_len = len(self.prompts[request // params.n])
            new_prompt = not taken or taken[-1] // params.n != request // params.n
            if new_prompt and taken and tokens + prompt_len > engine.max_prefill_tokens:
                break
            tokens += prompt_len if new_prompt else 0
            taken.append(self.waiting.popleft())
        slots = [self.free_slots.pop() for _ in taken]
        device = engine.device
        # One prefill per unique prompt (its first request's slot), then KV fan-out.
        firsts: list[int] = []  # index into `taken` of each unique prompt's first request
        group: list[int] = []  # unique-prompt index of each taken request
        for i, request in enumerate(taken):
            if not firsts or taken[firsts[-1]] // params.n != request // params.n:
                firsts.append(i)
            group.append(len(firsts) - 1)
        unique_prompts = [self.prompts[taken[i] // params.n] for i in firsts]
        lengths = torch.tensor([len(p) for p in unique_prompts])
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
        copy_pos = _ranges(copy_lengths)
        (
            ids, positions, token_slots, cu_dev, group_dev, seed_lo, seed_hi, row_positions,
            row_slots, max_new_dev, copy_src, copy_dst, copy_pos,
        ) = _upload(
            device,
            _flat_int64(unique_prompts), _ranges(lengths),
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
            self.results[request] = (tokens, logprobs, reason)
            self.free_slots.append(self.row_slot[row])
        self.state.keep_rows(keep, _upload(self.engine.device, torch.tensor(keep))[0])
        self.row_request = [self.row_request[r] for r in keep]
        self.row_slot = [self.row_slot[r] for r in keep]
        self.row_budget = [self.row_budget[r] for r in keep]
        self.row_end = [self.row_end[r] for r in keep]


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Python's cyclic garbage collector off inside (restored after). A full collection walks
    every object of the process (155 ms with torch, transformers and a 0.5b model loaded, on
    the CPU machine): in the middle of generate() it stops the host while the GPU drains the
    one chunk it has queued, and it fired in some timed calls but not others (H200, 0.5b:
    runs of 0.389 vs 0.473 s at 256 rows, 1.07 vs 1.20 s at 1024). The loop's own objects are
    lists of numbers, freed by reference counting; collection resumes when the call returns."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _flat_int64(lists: list[list[int]]) -> torch.Tensor:
    """Concatenated int lists as one int64 tensor (CPU). numpy's fromiter is ~8x faster than
    torch.tensor on a list here (16k tokens: 0.25 vs 2.0 ms on the CPU machine), and this is
    host time before the first prefill kernel, with the GPU idle."""
    return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64))


def _ranges(lengths: torch.Tensor) -> torch.Tensor:
    """[n0, n1, ...] -> [0..n0-1, 0..n1-1, ...] (int64, CPU)."""
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)


def _upload(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU int64 tensors -> device tensors through one pinned buffer and one non-blocking
    copy. (torch.tensor(list, device="cuda") copies from pageable memory, which waits for the
    GPU to drain: each admission would wait for the previous prefill pass to finish.)"""
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split(sizes))
