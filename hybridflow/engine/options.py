"""EngineOptions: every choice the generation engine makes, in one place, passed explicitly
from Engine(...) down to the function that uses it. The config's `rollout.engine.*` section
maps onto it (hybridflow/config/sections.py).

The defaults are what measured fastest on an H200 (docs/performance.md, Rollout engine; what
lost is in docs/engine.md, Tried and rejected). Choices the engine makes by timing (the decode
layer per batch bucket, matmul and attention tiles) are pinned in `cache_dir` (choices.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# How fp8 weights are scaled (fp8/weight_scales.py), here so the torch-free config can check the key
ENGINE_SCALES = "engine"
TRAINER_RECIPES = ("rowwise", "tensorwise")  # config/precision_checks.FP8_RECIPES
WEIGHT_SCALES = ("auto", ENGINE_SCALES, *TRAINER_RECIPES)

# The temperatures the sampler takes besides 0 (sampling.SamplingParams), here for the config too
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e4


DECODE_BACKENDS = ("auto", "triton", "torch")
FUSE_PROJECTIONS = ("all", "qkv", "none")
DECODE_MATMULS = ("auto", "cublas", "triton")
LEAN_VARIANTS = ("qkv+mlp", "qkv", "mlp")
WEIGHT_FORMATS = ("model", "fp8")
KV_CACHE_DTYPES = ("model", "fp8")
EXPERT_MATMULS = ("triton", "grouped_mm")
SERVICE_STREAMS = ("default", "priority")
DECODE_LAYERS = ("auto", "split", "chain", "lean", *(f"lean:{v}" for v in LEAN_VARIANTS))


@dataclass(frozen=True)
class EngineOptions:
    decode_backend: str = "auto"
    """"triton" (fused kernels, CUDA; the CPU only under TRITON_INTERPRET=1), "torch" (the
    model's own modules and SDPA over the cache: runs anywhere, bitwise the model's
    arithmetic), or "auto": triton on CUDA when Triton imports, else torch."""
    cuda_graphs: bool | None = None
    """Replay decode steps as CUDA graphs captured per batch-size bucket. None: on for CUDA."""
    steps_per_sync: int = 8
    """Decode steps between two host checks for finished rows (8 was fastest of 8/16/32/64 on
    an H200)."""
    sync_lag: int | None = None
    """Chunks the host's reads of finished flags and tokens lag the device: 1 lets the GPU
    run the next chunk while the host reads the last one (a finished row's slot is refilled
    up to two chunks after it finished); 0 waits for every chunk. None: 1 on CUDA, else 0."""
    max_prefill_tokens: int = 16384
    """Prompt tokens per packed prefill pass (bounds prefill activation memory)."""
    max_prefill_tokens_per_step: int = 0
    """Mixed steps (scheduler.py, mixed.py): each scheduler step runs one forward that
    carries every live row's next token and up to this many tokens of the prompts and
    continuations being prefilled, a long prompt in chunks over several steps, so a decode
    row waits at most one step for a new request (steps with nothing to prefill replay the
    decode graphs; a step with no row decoding takes up to max_prefill_tokens, and so do the
    steps after it until the burst it began is prefilled). At most
    max_prefill_tokens. 0: prompts and continuations in passes of their own before a chunk
    of decode steps (the path measured in docs/performance.md; the default until the mixed
    steps are measured on the GPU)."""
    graph_mixed_steps: bool = False
    """With max_prefill_tokens_per_step > 0, mixed steps with decode rows run with static
    shapes (scheduling/static_step.py): the rows padded to the decode graphs' batch buckets,
    the chunks' tokens to a bucket of the step's budget, their inputs copied into fixed
    buffers and their attention through the block table (kernels/chunk_attention.py), so a
    step replays as a CUDA graph instead of ~530 launches from Python. The fused (triton)
    backend only (an fp8 K/V cache included): models on the torch backend (recurrent,
    latent or sink-attention layers) keep the eager mixed step. False until measured on a
    GPU (bench agent --engine graph_mixed_steps=true)."""
    kv_block_size: int | None = 64
    """A power of two >= 16: the paged cache (kv_cache.py, blocks.py): blocks of that many
    positions handed out as sequences grow, a prompt's full blocks shared by its samples,
    admission by free blocks, and a sequence preempted (recomputed later, its tokens kept)
    when they run out; max_batch_size then only bounds the sequences decoded together.
    None: the slot cache (each of max_batch_size slots reserves max_seq_len positions).
    Paged by default: at one KV budget it decodes as many sequences as their actual lengths
    fit, not as many as max_seq_len does (7B, long-tail responses, 40 GiB on an H200: 1.95x
    the slot cache's tokens/s), and costs within 2% on short responses (docs/performance.md,
    "Paged KV cache"). 64 is the block size measured there."""
    cap_state_slots: bool = True
    """A model with per-sequence kinds (a hybrid's recurrent state, a sliding window's ring)
    in the paged cache under a bounded memory budget: at most the slots whose kinds and K/V
    blocks hold that many whole max_seq_len sequences at once (sizing.state_slots), since
    every slot's state is allocated up front and slots beyond that leave fewer whole
    sequences (qwen3.5-4b at 16k-token rows on an H200: 1,024 slots' states take 49 GiB and
    leave blocks for 40 rows; 124 slots hold 124). Logged when it caps max_batch_size.
    False: every one of max_batch_size slots gets its state (more rows at once only where
    responses stay well short of max_seq_len)."""
    admission_wait_chunks: int = 2
    """While rows decode, requests that arrive a few at a time (agent turns, a server's
    traffic) wait up to this many chunks of decode steps for others to share their prefill
    pass (each pass is a fixed cost: ~a millisecond of launches per layer stack); an eighth of
    the slots' worth of waiting requests is admitted at once. 0: admit at every chunk."""
    admission_gather_ms: float = 2.0
    """Rollout service, when nothing decodes: requests arriving a few at a time (the turns of
    episodes whose tools just returned) wait until none has arrived for this long (at most
    ten times as long in all) before the first prefill, so a burst decodes in step instead of
    in staggered cohorts that each take a whole chunk of steps at a fraction of the batch.
    An eighth of the slots' worth waiting starts at once. 0: start at the first request."""
    service_stream: str = "default"
    """Rollout service on CUDA, the stream its thread launches on. "default": the device's
    default stream, which another thread of the process (the trainer, in asynchronous RL on
    one GPU) shares: their kernels run one after the other, in launch order. "priority": a
    high-priority stream of its own, so decode kernels run beside the other thread's and are
    scheduled first (the next batch decodes while this one trains); where the service hands
    the weights over (pause, resume, update_weights, close) each stream waits for the other's
    work so far. "default" until the colocated asynchronous benchmark shows "priority" faster
    (docs/performance.md, Asynchronous RL)."""
    weight_format: str = "model"
    """"model": matmuls in the model's dtype. "fp8": W8A8 float8 e4m3 matmuls (fp8.py;
    per-channel weight scales quantized from the live weights at every sync, per-token
    activation scales; a mixture of experts' routed experts weight-only e4m3, fp8/experts.py),
    the rest in the model's dtype; the triton backend on a GPU with fp8
    tensor cores (sm_89+), the split decode layer, or for the layers the eager passes run
    (Qwen3.5, DeepSeek-V3, GPT-OSS) their projections in those passes (fp8/linears.py,
    which also says what stays in the model's dtype). The trainer corrects for the gap
    (rollout.dtype=fp8 turns truncated importance sampling on)."""
    fp8_weight_scales: str = "auto"
    """weight_format="fp8": how the weights are quantized (fp8/weight_scales.py). "engine": a scale
    per output channel, amax / 448. "rowwise" / "tensorwise": the FP8 trainer's recipe
    (torchao's, actor.fp8_recipe), so the rollout multiplies by the e4m3 weights and scales of
    the trainer's forward, bit for bit (the fused copies then keep the norm weights out).
    "auto": the actor's recipe when actor.precision=fp8 (workers/rollout.engine_options), else
    engine."""
    kv_cache_dtype: str = "model"
    """"model": K/V cached in the model's dtype. "fp8": float8 e4m3 with a scale per position
    and kv head (cache/fp8_kv.py): half the bytes a cached token (plus 4 per head for its
    scale), so twice the tokens in the same budget; decode attention dequantizes each tile.
    The paged cache (kv_block_size) of full-attention models only; the shared-prefix
    grouping (shared_prefix) does not run over it. The sampled tokens' log-probs move by what
    the rounding of K/V adds (docs/engine.md, FP8 KV cache)."""
    fuse_projections: str = "all"
    """triton backend: "all" keeps a concatenated copy of each layer's q/k/v and interleaved
    gate/up weights with the RMSNorm weights folded in (one matmul instead of three and two;
    ~70% of the non-embedding weights, refreshed at every generate(), outside the KV budget);
    "qkv" copies q/k/v only (~10%); "none" reads every weight in place. H200, 0.5B, 256
    prompts: all 128k, qkv 122k, none 113k tok/s (before the other fusions)."""
    decode_matmul: str = "auto"
    """triton backend, the MLP's gate/up projection with SiLU*up: "auto" times cuBLAS +
    silu_mul against Triton tiles with SiLU*up in the epilogue once per shape and keeps the
    faster; "cublas" never uses Triton; "triton" always does. Every other matmul is cuBLAS
    (it won every other decode shape)."""
    persistent_matmul: bool = True
    """With decode_matmul auto/triton: also time the persistent gate/up kernel (one program
    per SM walking the tiles) at 1024+ rows, where it can win (prefill, large batches)."""
    decode_layer: str = "auto"
    """The decode layer (layers/): "split" (eight launches a layer, cuBLAS matmuls), "chain"
    (five launches, the norms and residual adds inside Triton matmuls), "lean" (cuBLAS, the
    norms inside attention and SiLU*up; all three variants timed), "lean:qkv+mlp" /
    "lean:qkv" / "lean:mlp" (one variant), or "auto": every applicable layer timed once per
    batch-size bucket, the fastest kept (the chain must win by 2%). A forced layer that does
    not apply to the model or options falls back to split."""
    record_routes: bool = True
    """Mixture-of-experts models: record each token's experts per sparse layer beside its K/V
    (one byte per expert id up to 256 experts) and return them with each completion
    (`Completion.routed_experts`), for the trainer's routing replay."""
    expert_matmul: str = "triton"
    """Mixture-of-experts models on the triton backend: "triton" runs every pass's experts on
    the Triton grouped kernels (kernels/experts/moe.py: only the touched experts' weights are read);
    "grouped_mm" runs prefill and extend passes of 1024+ tokens on torch._grouped_mm where it
    runs (Hopper, 16-bit), decode steps on Triton. H200, one 30B-A3B layer at 16,384 tokens:
    Triton 3.6 ms, torch._grouped_mm 4.4 ms (benchmarks/moe_layer.py)."""
    shared_prefix: bool = True
    """With n > 1 on the triton backend, decode attention reads each prompt's cached prefix
    once per group of its samples (64 prompts x 8: 9.3% faster at 0.5b, 11.2% at 1.5b)."""
    pdl: bool | None = None
    """Programmatic dependent launch of the Triton decode kernels (each may start while the
    previous one drains). None: wherever supported (sm_90+, Triton >= 3.4); True where it is
    not supported is an error."""
    prefetch_weights: bool = True
    """With PDL, a Triton matmul asks L2 for the start of its weight before waiting for the
    kernel that writes its input."""
    tma: bool | None = None
    """Triton matmul tiles through TMA tensor descriptors (5-10% faster per matmul). None: on
    sm_90+ GPUs."""
    attention_autotune: bool = True
    """Time the decode attention tile per shape (CUDA); off: a fixed tile."""
    cache_dir: str | None = None
    """Directory of the pinned timing choices (choices.py): a JSON file per (model shape, GPU,
    dtype, options), read at the first generate() and written when a choice is new, so later
    processes make the same choices without timing. None: choices live in the process only."""
    retune: bool = False
    """Ignore pinned choices and time again (the new ones replace them in cache_dir)."""
    speculative: str = "off"
    """Speculative decoding of the tail (speculative/): "ngram" drafts up to
    speculative_draft_tokens tokens per row from n-gram matches in its prompt, in its own
    tokens and in earlier responses of the same prompt (its finished siblings, earlier
    epochs), and scores them in one extend pass beside the rows with no draft; speculative
    sampling keeps the emitted tokens distributed exactly as without it (for a seed, they are
    the same tokens). "draft": a small model sharing the tokenizer
    (speculative_draft_model) samples the drafts, accepted by speculative sampling (the
    distribution exact; greedy tokens the same). Runs while at most speculative_max_rows
    rows decode, where the measured rule (speculative_rule) finds it pays. "off" until
    measured on a GPU (bench rollout --speculative)."""
    graph_verify_steps: bool = False
    """With speculative on, verify passes run with static shapes (speculative/
    static_verify.py): the rows padded to the decode graphs' batch buckets, their drafts
    packed as chunks of their rows padded to speculative_draft_tokens a row, the logits of
    every position into a fixed buffer, so a pass replays as a CUDA graph in the same step
    as the rows with no draft (acceptance stays eager after it). The fused (triton) backend
    over full-attention K/V caches only (in the model's dtype or fp8): refused, naming this
    key, on engines with recurrent, latent or sink-window layers (the torch backend). False
    until measured on a GPU (bench rollout --speculative --engine graph_verify_steps=true)."""
    speculative_draft_model: str | None = None
    """speculative="draft": a preset name or a local HF directory of the draft model (the
    target's tokenizer; its embedding table may be padded to another size), loaded in the
    engine's dtype on its device (ignored by the other methods)."""
    speculative_draft_tokens: int = 4
    """Draft tokens per row and verify pass (at most steps_per_sync)."""
    speculative_max_rows: int = 16
    """Verify passes replace chunks of decode steps while at most this many rows decode (the
    long tail, where a decode step reads the weights for a few tokens)."""
    speculative_min_ngram: int = 2
    """Shortest suffix of a row's tokens matched against the draft sources."""
    speculative_max_ngram: int = 4
    """Longest suffix matched (longer matches are tried first)."""
    speculative_store_tokens: int = 1 << 20
    """Tokens of finished responses kept as draft sources for later samples of their prompt
    (host memory: ~40 bytes a token, ~0.5 KB once indexed, which only the prompts of rows
    that speculate are; 0: none kept)."""
    speculative_rule: str = "measured"
    """When a tail step verifies: "measured" (speculative/rule.py) while the tokens a row
    emits per verify pass times the seconds of a plain decode step exceed the pass's seconds
    by speculative_margin, as the engine measures them in the tail, re-probing the other
    kind of step every speculative_probe_steps tail steps; "always": whenever some row has a
    draft (the row count alone)."""
    speculative_margin: float = 0.1
    """The measured rule's margin: verify while tokens x step seconds > (1 + margin) x pass
    seconds."""
    speculative_probe_steps: int = 16
    """The measured rule re-probes every this many tail steps: one verify pass while
    speculation is off, one plain decode step while it is on."""

    def validate(self) -> list[str]:
        """Problems as 'field=value: what to change' lines (empty when valid)."""
        problems = []

        def one_of(name, allowed):
            value = getattr(self, name)
            if value not in allowed:
                problems.append(f"{name}={value!r}: must be one of {', '.join(allowed)}")

        one_of("decode_backend", DECODE_BACKENDS)
        one_of("fuse_projections", FUSE_PROJECTIONS)
        one_of("decode_matmul", DECODE_MATMULS)
        one_of("decode_layer", DECODE_LAYERS)
        one_of("weight_format", WEIGHT_FORMATS)
        one_of("fp8_weight_scales", WEIGHT_SCALES)
        one_of("kv_cache_dtype", KV_CACHE_DTYPES)
        if self.kv_cache_dtype == "fp8" and self.kv_block_size is None:
            problems.append("kv_cache_dtype='fp8' covers the paged cache only: set "
                            "kv_block_size (e.g. 64), or kv_cache_dtype=model")  # fmt: skip
        one_of("service_stream", SERVICE_STREAMS)
        one_of("expert_matmul", EXPERT_MATMULS)
        if self.weight_format == "fp8" and self.decode_layer not in ("auto", "split"):
            problems.append(f"weight_format='fp8' runs the split decode layer; decode_layer="
                            f"{self.decode_layer!r} reads bf16 weights: use auto or split")  # fmt: skip
        if self.weight_format == "fp8" and self.decode_backend == "torch":
            problems.append("weight_format='fp8' needs the triton decode backend (auto on a GPU)")
        if not isinstance(self.cap_state_slots, bool):
            problems.append(f"cap_state_slots={self.cap_state_slots!r}: must be true or false")
        if not isinstance(self.steps_per_sync, int) or self.steps_per_sync < 1:
            problems.append(f"steps_per_sync={self.steps_per_sync!r}: must be an integer >= 1")
        if self.sync_lag not in (None, 0, 1):
            problems.append(f"sync_lag={self.sync_lag!r}: must be 0, 1 or null (auto)")
        if not isinstance(self.admission_wait_chunks, int) or self.admission_wait_chunks < 0:
            problems.append(f"admission_wait_chunks={self.admission_wait_chunks!r}: must be an "
                            "integer >= 0")  # fmt: skip
        gather = self.admission_gather_ms
        if isinstance(gather, bool) or not isinstance(gather, (int, float)) or not gather >= 0:
            problems.append(f"admission_gather_ms={gather!r}: must be a number >= 0")
        block = self.kv_block_size
        if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                                  or block < 16 or block & (block - 1)):  # fmt: skip
            problems.append(f"kv_block_size={block!r}: must be null (slot cache) or a power "
                            "of two >= 16")  # fmt: skip
        if not isinstance(self.max_prefill_tokens, int) or self.max_prefill_tokens < 1:
            problems.append(
                f"max_prefill_tokens={self.max_prefill_tokens!r}: must be an integer >= 1"
            )
        per_step = self.max_prefill_tokens_per_step
        if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 0:
            problems.append(f"max_prefill_tokens_per_step={per_step!r}: must be an integer >= 0 "
                            "(0: prefill passes of their own)")  # fmt: skip
        elif isinstance(self.max_prefill_tokens, int) and 1 <= self.max_prefill_tokens < per_step:
            problems.append(f"max_prefill_tokens_per_step={per_step}: at most max_prefill_tokens="
                            f"{self.max_prefill_tokens} (the prefill activations' reserve)")  # fmt: skip
        if not isinstance(self.graph_mixed_steps, bool):
            problems.append(f"graph_mixed_steps={self.graph_mixed_steps!r}: must be true or false")
        elif self.graph_mixed_steps and per_step == 0:
            problems.append("graph_mixed_steps=true captures mixed steps: set "
                            "max_prefill_tokens_per_step > 0 too (e.g. 2048)")  # fmt: skip
        from hybridflow.engine.speculative.options import speculative_problems

        return problems + speculative_problems(self)

    def checked(self) -> EngineOptions:
        """self, or ValueError listing every problem."""
        problems = self.validate()
        if problems:
            raise ValueError("invalid engine options:\n  " + "\n  ".join(problems))
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> EngineOptions:
        """From a mapping of field names (unknown names raise, naming them)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; known: {sorted(known)}")
        return cls(**values)

    def timing_identity(self) -> dict:
        """The options that change what timing chooses (the pinned choices' key)."""
        skip = {
            "cache_dir",
            "retune",
            "steps_per_sync",
            "sync_lag",
            "cuda_graphs",
            "admission_wait_chunks",
            "admission_gather_ms",
            "max_prefill_tokens_per_step",
            "graph_mixed_steps",
            "graph_verify_steps",
            "service_stream",
            "record_routes",
            "kv_block_size",  # the attention tile keys on it itself (kernels/attention.py)
            "speculative",  # verify passes run the extend path's untimed choices
            "speculative_draft_tokens",
            "speculative_max_rows",
            "speculative_min_ngram",
            "speculative_max_ngram",
            "speculative_store_tokens",
            "speculative_draft_model",  # the draft runs its own eager extend passes
            "speculative_rule",
            "speculative_margin",
            "speculative_probe_steps",
        }
        if self.weight_format != "fp8":  # read by the fp8 matmuls only: model-dtype engines
            skip.add("fp8_weight_scales")  # keep the choices pinned before it existed
        if self.kv_cache_dtype == "model":  # model-dtype caches keep their pinned choices
            skip.add("kv_cache_dtype")
        return {k: v for k, v in asdict(self).items() if k not in skip}
