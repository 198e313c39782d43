"""Engine: token ids in, token ids + log-probs out, with continuous batching.

    engine = Engine(model, max_batch_size=256, max_seq_len=1024)
    completions = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=256, seed=0))
    engine.release()  # KV cache freed; the next generate() allocates it again

The Engine owns the device memory (KV cache, decode state, fused weight copies, captured
graphs) and the choices made per shape (pinned across processes: choices.py); the host
bookkeeping (admission, chunks of decode steps, reading tokens back one chunk late) is
scheduler.Scheduler, which generate() runs until its prompts are done and the rollout service
(service.py: requests submitted from any thread while others decode) runs on its own thread.
Every choice is an EngineOptions field (options.py); which backend runs them, backend.py;
what is allocated before generating, allocation.py.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from hybridflow.engine.allocation import allocate
from hybridflow.engine.backend import check_fp8_kv, resolve_backend, triton_pieces
from hybridflow.engine.cache import kv_cache
from hybridflow.engine.cache.arithmetic import eager_only
from hybridflow.engine.cache.kinds import engine_gaps
from hybridflow.engine.choices import (
    PinnedChoices,
    load_engine_choices,
    pin_recorded_choices,
    record_engine_choices,
    recorded_choices,
)
from hybridflow.engine.fp8.weight_scales import ENGINE_SCALES
from hybridflow.engine.graphs import DecodeRunner
from hybridflow.engine.host import cyclic_gc_paused
from hybridflow.engine.images import ImageFeatures, prepare_images
from hybridflow.engine.options import EngineOptions
from hybridflow.engine.prefill import extend_forward, prefill_forward
from hybridflow.engine.requests import (
    Completion,
    PromptTable,
    Submission,
    padded_tensors,
)
from hybridflow.engine.sampling import SamplingParams, call_seeds
from hybridflow.engine.scheduling.kept import KeptKV
from hybridflow.engine.scheduling.scheduler import Scheduler
from hybridflow.engine.scheduling.tail import TailStats
from hybridflow.engine.state import DecodeState
from hybridflow.engine.weights.fused import copy_named_tensors


class Engine:
    """Generation engine over a hybridflow CausalLM's parameters (in place, no copy).

    Args:
        model: hybridflow.models.CausalLM. Anything else with forward(input_ids,
            attention_mask) -> logits and a .config with vocab_size/eos_token_id (the
            transformers fallback, models/checkpoint_io/hf_fallback.py) runs the slow path (slow.py).
            A tensor-parallel shard (tensor_parallel.tensor_parallel_model) runs on every
            rank of its group (the eager path, or the triton backend's split layer), each
            rank calling generate with the same prompts and sampling the same tokens.
        max_batch_size: sequences decoded together (KV-cache slots).
        max_seq_len: prompt + generated tokens per sequence.
        memory_budget: KV-cache bytes (int), fraction of free device memory (float in (0, 1]),
            or None (all of max_batch_size if it fits in 90% of free memory).
        options: EngineOptions (every choice of how to run; the defaults are the fastest
            measured).
    """

    def __init__(
        self,
        model,
        max_batch_size: int = 256,
        max_seq_len: int = 2048,
        memory_budget: int | float | None = None,
        options: EngineOptions | None = None,
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
        self.options = options = (options or EngineOptions()).checked()
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.memory_budget = memory_budget
        self._capped_reported = False  # the slots' cap is logged once (allocation.py)
        self.steps_per_sync = options.steps_per_sync
        self.max_prefill_tokens = options.max_prefill_tokens
        from hybridflow.models.llama import CausalLM

        # else: slow path (slow.py), with the reason; so are layer kinds whose cache kind the
        # engine has not built yet (an attention layer's window: cache/kinds.py)
        self.slow_reason = "not hybridflow's own decoder" if not isinstance(model, CausalLM) else (
            "; ".join(engine_gaps(self.config.layer_specs())) or None)  # fmt: skip
        self.native = self.slow_reason is None
        # Layers the fused decode layers (split, chain, lean) do not run: gated attention,
        # Gated DeltaNet, MLA, a shared expert. Their engine runs the model's own modules (the
        # torch backend) and steps the recurrent states and MLA's absorbed attention with the
        # Triton kernels where the triton backend would run (kernels/delta_step.py,
        # kernels/latent_attention.py).
        self.eager_layers = self.native and eager_only(self.config.layer_specs())
        from hybridflow.engine.layers.moe import ExpertMatmuls, has_experts

        # mixture-of-experts layers run through layers/moe.py: routing recorded for replay,
        # the experts' packed weights read in place
        self.moe = self.native and has_experts(model)
        self.experts = ExpertMatmuls(1024 if options.expert_matmul == "grouped_mm" else None)
        from hybridflow.engine.tensor_parallel import tensor_parallel_size

        # a tensor-parallel shard (tensor_parallel.py): its all-reduces run in the eager
        # modules or, on the triton backend, the split layer (layers/split.py)
        self.tensor_parallel = tensor_parallel_size(model)
        from hybridflow.engine.expert_spread import engine_spreads_experts

        # experts over the replicas (expert_spread.py): rounds of the group, the all-to-all's
        # sizes read on the host at every sparse layer (no CUDA graphs)
        self.spread = engine_spreads_experts(model, options)
        self.decode_backend = resolve_backend(options.decode_backend, self.device)
        self.recurrent_step = "torch"
        if self.eager_layers:
            self.recurrent_step = self.decode_backend
            self.decode_backend = "torch"
        # a vision-language model: prompts with images (images.py) decode with a per-slot
        # rotary shift, which both backends read (RopeTable.slot_shift); their prefill and
        # mixed steps take the embeddings with the vision encoder's features and each token's
        # cos/sin from mRoPE's three rows
        self.vision = self.native and getattr(self.config, "vision", None) is not None
        triton_backend = self.decode_backend == "triton"
        cuda = self.device.type == "cuda"
        # a tensor-parallel step's collectives in a graph: not measured yet, so asked for
        graphs_default = cuda and self.tensor_parallel == 1 and not self.spread
        self.cuda_graphs = graphs_default if options.cuda_graphs is None else options.cuda_graphs
        self.sync_lag = int(cuda) if options.sync_lag is None else options.sync_lag
        from hybridflow.engine.adapters import adapter_layers

        self.adapted = bool(adapter_layers(model))  # LoRA decoded unmerged (adapters.py)
        # fused copies would hold the base weights only
        fuse = triton_backend and not self.adapted
        self.fuse_projections = options.fuse_projections if fuse else "none"
        if self.moe and self.fuse_projections == "all":  # experts are never copied
            self.fuse_projections = "qkv"
        self.pinned = PinnedChoices()
        if triton_backend:
            self.pinned = load_engine_choices(self.config, self.dtype, self.device, options)
        self.fused = None
        self.fp8 = None  # fp8.Fp8Matmul with weight_format="fp8", made with the cache
        # fp8 with a vision-language model: the language model's projections go fp8 in every
        # pass, those with images included (their embeddings go through the same fused
        # layers); the vision encoder stays in the model's dtype (images.encode_missing)
        if options.weight_format == "fp8":
            from hybridflow.engine.fp8.matmul import check_fp8_engine

            # eager layers: their projections fp8 in the eager passes (fp8/linears.py), on
            # the backend the engine resolved for their steps
            backend = self.recurrent_step if self.eager_layers else self.decode_backend
            check_fp8_engine(self.device, backend, self.adapted, self.eager_layers)
        self.kv_fp8 = options.kv_cache_dtype == "fp8"  # cache/fp8_kv.py
        if self.kv_fp8:
            check_fp8_kv(self)
        # "auto" is the trainer's recipe where a trainer names one (workers/rollout.py)
        scales = options.fp8_weight_scales
        fp8_recipe = options.weight_format == "fp8" and scales != "auto"
        self.fp8_weight_scales = scales if fp8_recipe else ENGINE_SCALES
        self.matmul = self.chain = self.chooser = None
        self.launch = None
        if triton_backend:  # kept across release(): shape choices
            # fp8 projections run in the split layer (the others read bf16 weights in Triton);
            # so does a tensor-parallel shard: the chain and lean layers fuse o_proj and
            # down_proj into their neighbours, leaving no place for the all-reduces
            split = (options.weight_format == "fp8" or self.adapted or self.moe
                     or self.tensor_parallel > 1)  # fmt: skip
            self.launch, self.matmul, self.chain, self.chooser = triton_pieces(
                options, self.device, self.pinned, split)  # fmt: skip
        self.cache: kv_cache.KVCache | None = None
        self.blocks = None  # blocks.BlockPool of a paged cache (options.kv_block_size)
        self.state: DecodeState | None = None
        self.runner: DecodeRunner | None = None
        self.rope = None
        self.prefill = prefill_forward
        self.extend = extend_forward
        self.kept = KeptKV()  # slots kept for the next turn of their conversation
        self.scheduler: Scheduler | None = None  # made with the cache
        self.service = None  # the RolloutService driving this engine, while one runs
        self.released_weights = None  # weights/release.ReleasedWeights while freed
        self.policy_version = 0  # bumped by load_weights / new_policy_version
        self.prefill_tokens = 0  # prompt tokens run through prefill or extend (a counter)
        self.tail = TailStats()  # the long tail's steps and seconds (scheduling/tail.py)
        # verify passes of drafted tokens in the tail (speculative/verify.py), or None
        from hybridflow.engine.speculative.verify import engine_speculation

        self.speculation = engine_speculation(self)

    # -- pinned choices (choices.py) -----------------------------------------------------------

    def _record_choices(self) -> None:
        """Every choice made so far into the pinned set, saved if any is new."""
        if self.decode_backend == "triton":
            record_engine_choices(self.pinned)

    def pinned_choices(self) -> dict:
        """The timing choices this engine runs with (a checkpoint records them); asked of a
        running service's thread, which may be timing a new shape meanwhile."""
        if self.service is not None and not self.service.on_engine_thread():
            return self.service._call(self.pinned_choices)
        self._record_choices()
        return recorded_choices(self.pinned)

    def pin_choices(self, recorded: dict) -> bool:
        """Run with choices recorded earlier (pinned_choices() of a run with the same model,
        GPU, dtype, options and versions); False, and nothing changed, when they were made
        for something else."""
        return pin_recorded_choices(self.pinned, recorded, self.decode_backend == "triton")

    # -- memory ---------------------------------------------------------------------------------

    def _allocate(self) -> None:
        allocate(self)  # allocation.py

    def release(self) -> None:
        """Free the KV cache, decode state and captured graphs (memory back to training);
        kept KV goes with it."""
        if self.service is not None and not self.service.on_engine_thread():
            return self.service._call(self.release)
        if self.scheduler is not None and self.scheduler.busy:
            raise RuntimeError("Engine.release: requests are still running (pause the service "
                               "and let them finish, or abort them, first)")  # fmt: skip
        self.kept.clear()
        self.scheduler = None
        self.cache = self.state = self.runner = self.rope = self.fused = self.fp8 = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.service is not None:  # its thread: the caller reuses the memory after this
            self.service.streams.hand_back()

    def release_weights(self) -> int:
        """Free the parameters' storage until :meth:`restore_weights` (weights/release.py),
        after which the caller rewrites every parameter; generating in between raises.
        -> bytes freed."""
        if self.service is not None:
            raise RuntimeError("Engine.release_weights: a service is decoding on these weights")
        if self.released_weights is not None:
            return 0
        from hybridflow.engine.weights.release import release_parameters

        self.released_weights = release_parameters(self.model)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.released_weights.nbytes

    def restore_weights(self):
        """The storage freed by :meth:`release_weights` allocated again, its contents
        undefined: -> the weights/release.ReleasedWeights record (None: nothing was freed),
        for the caller to check it rewrote every one (weights/release.check_rewritten)."""
        released, self.released_weights = self.released_weights, None
        if released is not None:
            released.restore()
        return released

    def _check_weights_held(self) -> None:
        if self.released_weights is not None:
            raise RuntimeError("the engine's weights were released (rollout.release_weights) "
                               "and not loaded again: sync the weights before generating")  # fmt: skip

    @property
    def num_slots(self) -> int:
        if self.cache is None:
            self._allocate()
        return self.cache.num_slots

    @torch.no_grad()
    def load_weights(self, named_tensors, bucket_bytes: int = 256 * 2**20) -> None:
        """Copy (name, tensor) pairs (HF names) into the model's parameters, in buckets of about
        bucket_bytes (one device sync per bucket bounds the staging memory). Kept KV was made
        by the old weights: it is dropped. Tokens sampled afterwards carry a new policy
        version (Completion.version_spans). While a RolloutService runs, use its
        update_weights (it pauses decoding around the copy)."""
        if self.service is not None and not self.service.on_engine_thread():
            self.service.update_weights(named_tensors)
            return
        copy_named_tensors(self.model, named_tensors, self.device, bucket_bytes)
        self.new_policy_version()

    def weights_updated(self) -> int:
        """The parameters were changed in place (a colocated trainer's optimizer step): a new
        policy version begins; a running service refreshes its fused weight copies before
        its next chunk (generate() refreshes them at every call anyway). -> the version."""
        if self.service is not None and not self.service.on_engine_thread():
            self.service.resume(weights_changed=True)
            return self.policy_version
        return self.new_policy_version()

    def new_policy_version(self, version: int | None = None) -> int:
        """The weights changed (loaded, or updated in place by a colocated trainer): kept KV
        is dropped and tokens sampled from now on record `version` (default: the last + 1).
        Live requests keep their K/V (their earlier tokens keep the old version)."""
        if self.service is not None and not self.service.on_engine_thread():
            return self.service._call(lambda: self.new_policy_version(version))
        self.policy_version = self.policy_version + 1 if version is None else int(version)
        if self.scheduler is not None:
            self.scheduler.flush()
            self.scheduler.drop_kept()
            self.scheduler.new_version(self.policy_version)
        else:
            self.kept.clear()
        return self.policy_version

    # -- generation -----------------------------------------------------------------------------

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        stop = list(params.stop_token_ids)
        eos = self.config.eos_token_id
        if not params.ignore_eos and eos is not None:
            stop += list(eos) if isinstance(eos, (list, tuple)) else [eos]
        return sorted(set(stop))

    def _prompt_table(self, prompts: list[list[int]]) -> PromptTable:
        """Lengths checked now (ValueError naming the first bad prompt); ids checked by
        table.check() (the loop checks them in pieces around the first prefill)."""
        return PromptTable(prompts, self.config.vocab_size, self.max_seq_len)

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        """Raise ValueError naming the first bad prompt (empty, too long, ids out of range)."""
        self._prompt_table(prompts).check()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None, *, keep: bool = False,
                 reuse: list[int | None] | None = None,
                 max_new_tokens: list[int] | None = None,
                 sample_index: list[int] | None = None,
                 images: list | None = None) -> list[Completion]:  # fmt: skip
        """n completions per prompt, prompt-major: result[i * n + j] is sample j of prompt i.

        seeds: a base seed per prompt (instead of params.seed): prompt i samples exactly as a
        call of it alone with seed=seeds[i] would (a server batching independent requests).
        keep: each finished sample keeps its KV (Completion.kv_handle; kept.py). reuse (n=1):
        per prompt a handle from an earlier call (or None): a prompt that extends that
        handle's tokens prefills only the rest; the samples are the same either way.
        max_new_tokens: a budget per request (prompt-major, len(prompts) * n), instead of
        params.max_new_tokens for all. sample_index: these prompts are part of a larger call
        with params.seed (a batch split over processes): prompt i's sample j draws as that
        call's sample sample_index[i] + j (sampling.indexed_request_seeds), so the tokens do
        not depend on how the call was split. images: per prompt its images.PromptImages (or
        None), the prompt's ids holding an image-pad token per merged patch (a
        vision-language model). While a RolloutService runs this engine, the prompts are
        submitted to it (and decode beside its other requests, across its weight updates:
        partial rollouts; a request recomputed after preemption prefills its images again)."""
        self._check_weights_held()
        if self.service is not None:
            if max_new_tokens is not None:
                raise ValueError("max_new_tokens per request: not through a running service")
            return self.service.generate(prompts, params, seeds, keep=keep, reuse=reuse,
                                         sample_index=sample_index, images=images)  # fmt: skip
        with cyclic_gc_paused():  # also while the results are made (thousands of objects)
            return self._generate(prompts, params, seeds, keep=keep, reuse=reuse,
                                  max_new_tokens=max_new_tokens,
                                  sample_index=sample_index, images=images)  # fmt: skip

    def release_kept(self, handles) -> None:
        """Give kept slots back (their handles become invalid; unknown ones are ignored)."""
        if self.service is not None and not self.service.on_engine_thread():
            self.service.release_kept(handles)
        elif self.scheduler is not None:
            self.scheduler.release_kept(handles)
        else:
            self.kept.release(handles)

    def submission(self, prompts, params: SamplingParams, seeds=None, keep=False, reuse=None,
                   listener=None, on_finish=None, max_new_tokens=None,
                   sample_index=None, images=None) -> Submission:  # fmt: skip
        """The scheduler's unit of work for these prompts; lengths checked (ValueError naming
        the first bad prompt), token ids checked when admitted (or by table.check())."""
        table = self._prompt_table(prompts)
        n = params.n
        limit = self.max_seq_len
        budgets = max_new_tokens or [params.max_new_tokens] * (len(prompts) * n)
        if len(budgets) != len(prompts) * n or min(budgets, default=1) < 1:
            raise ValueError(f"max_new_tokens: {len(budgets)} budgets >= 1 for "
                             f"{len(prompts)} prompts x n={n} requests")  # fmt: skip
        max_new = [min(budget, limit - len(prompts[i // n])) for i, budget in enumerate(budgets)]
        seed_values = call_seeds(len(prompts), params, seeds, sample_index)
        sub = Submission(table, params, seed_values, max_new,
                         self._stop_ids(params), keep=keep, reuse=reuse, listener=listener,
                         on_finish=on_finish)  # fmt: skip
        prepared = prepare_images(self.config, prompts, images)
        if prepared is not None:
            sub.images = ImageFeatures(prepared, n)
        return sub

    def start_generation(self) -> None:
        """Before the scheduler runs after a pause: the cache allocated, the fused weight
        copies refreshed (the weights may have changed in place), graphs re-captured if a
        parameter moved."""
        self._check_weights_held()
        if self.fused is not None:
            # Queued first: the GPU copies while the host builds the first prefill's inputs.
            self.fused.refresh(self.model)
        if self.fp8 is not None:
            self.fp8.refresh()  # after the fused copies it quantizes
        if self.cache is None:
            self._allocate()  # makes (and fills) the fused copies
        self.runner.check_weights()

    def shares_prefixes(self, n: int) -> bool:
        """Whether decode steps with n samples per prompt read each prompt's prefix once per
        group of its samples (EngineOptions.shared_prefix; the triton backend)."""
        shared = self.options.shared_prefix and not self.kv_fp8  # its kernel reads bf16 K/V
        return self.decode_backend == "triton" and shared and n > 1

    @torch.no_grad()
    def warm_up(self, params: SamplingParams) -> int:
        """Capture every batch bucket's decode graph (and mixed steps' graphs) for `params`'
        sampling mode now, with the timing choices each makes, not when a batch first has that
        many rows: a server whose batch size wanders (requests come and go) would otherwise
        stall at each new size. -> graphs captured. Idle engines only."""
        if self.service is not None and not self.service.on_engine_thread():
            return self.service._call(lambda: self.warm_up(params))
        if not self.native or self.scheduler is not None and self.scheduler.busy:
            return 0
        self.start_generation()
        self.runner.set_mode(params, shared=self.shares_prefixes(params.n))
        context = torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()
        with context:
            captured = self.scheduler.capture_graphs()
        self._record_choices()
        return captured

    @torch.no_grad()
    def _generate(self, prompts, params: SamplingParams, seeds=None, keep=False,
                  reuse=None, max_new_tokens=None, sample_index=None,
                  images=None) -> list[Completion]:  # fmt: skip
        if not self.native and images is not None:
            raise ValueError(f"prompts with images need hybridflow's own decoder; the engine "
                             f"runs this model on its slow path ({self.slow_reason})")  # fmt: skip
        if not self.native:
            from hybridflow.engine.slow import generate_slow

            if max_new_tokens is not None:
                raise ValueError("max_new_tokens per request needs the engine's own decoder")
            seed_values = call_seeds(len(prompts), params, seeds, sample_index)
            results = generate_slow(self, prompts, params, seed_values)
            self._serve_peers()
            return results
        sub = self.submission(prompts, params, seeds, keep=keep, reuse=reuse,
                              max_new_tokens=max_new_tokens, sample_index=sample_index,
                              images=images)  # fmt: skip
        self.start_generation()
        try:
            with cyclic_gc_paused():
                if self.device.type != "cuda":
                    results = self.scheduler.run(sub)
                else:
                    with torch.cuda.device(self.device):  # graphs and side streams on its GPU
                        results = self.scheduler.run(sub)
        except BaseException:
            self._reset_scheduler()  # a bad prompt id, an interrupt: nothing half-admitted
            raise
        self._serve_peers()
        self._record_choices()
        return results

    def _serve_peers(self) -> None:
        """Experts across replicas: the other replicas' tokens still need this rank's
        experts after its own requests are done (expert_spread.py)."""
        if self.spread:
            from hybridflow.engine.expert_spread import serve_peers

            serve_peers(self.model, self.device, self.peer_experts())

    def peer_experts(self):
        """serve_peers' run_local_of for this engine (layers/moe.engine_local_experts)."""
        from hybridflow.engine.layers.moe import engine_local_experts

        return engine_local_experts(self)

    def _reset_scheduler(self) -> None:
        if self.state is None:
            return
        self.state.keep_rows([])
        self.scheduler = Scheduler(self)
        self.scheduler.version = self.policy_version

    def generate_padded(
        self, prompts: list[list[int]], params: SamplingParams, pad_token_id: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Tensors for the trainer, prompt-major rows [B * n]: responses [B*n, R] int64
        right-padded with pad_token_id, rollout_logprobs [B*n, R] fp32 (0 on padding),
        response_lengths [B*n] int64; R = longest response. On CPU."""
        results = self.generate(prompts, params)  # through a running service, if any
        if pad_token_id is None:
            pad_token_id = self.config.pad_token_id or 0
        return padded_tensors(results, pad_token_id)
