"""The memory plan: bytes on each GPU and on the host, item by item, before any model loads.

Pure arithmetic on a :class:`~hybridflow.models.architecture.ModelArchitecture` and the
options that decide what the code allocates (:class:`PlanOptions`); no torch, no config
objects. ``trainer/plan/memory_from_config.py`` builds the options from a run's config,
``memory_check.py`` checks the peak against the GPU and ``memory_fixes.py`` names the changes
that would make a run fit.

What is modelled is what the code does today:

- **Master weights** of a trained model (actor, critic) are in the training dtype: fp32 for
  ``model.dtype=auto`` on a GPU (``workers/model_loading.training_dtype``), sharded over the
  data-parallel ranks by FSDP2, on the host with ``param_offload`` (FSDP2 only: on one GPU
  ``param_offload`` does nothing, ``learners/core.TrainCore``) or with ``optimizer_offload``
  (one GPU only; the GPU then holds the trained weights in bf16).
- **LoRA adapters** come on top of the frozen base, in fp32 whatever the base's dtype
  (``learners/lora.apply_lora``): small for a dense model, 2.6 B parameters (9.6 GiB) at rank
  64 on every expert of Qwen3-30B-A3B. With ``optimizer_offload`` their fp32 masters and
  AdamW state are on the host and the GPU holds bf16 copies.
- **Compute copy**: with fp32 masters the forward runs in bf16, and a bf16 copy of every
  weight lives through a micro-batch's forward and backward: autocast caches its casts and
  autograd keeps them for the backward (one GPU); FSDP2 keeps each unit gathered for the
  whole mini-batch (``TrainCore.accumulate_unsharded``). The log-prob head casts the
  lm_head weight once more (``learners/modules.PolicyModel``).
- **Gradients** in the dtype of the trained weights on the GPU (fp32 masters; bf16 with
  ``optimizer_offload``), freed after every optimizer step (``zero_grad(set_to_none=True)``;
  bucket by bucket with ``optimizer_offload``). FSDP2 with several micro-batches keeps
  unsharded fp32 gradients until the last one, then reduce-scatters them.
- **AdamW state**: two moments in the master dtype per trainable parameter. It stays on the
  GPU from the first step on; ``actor.optimizer_offload`` (one GPU) keeps it and the masters
  on the host for the whole run and steps there (``learners/host_optimizer``), through two
  pinned bf16 staging buffers and an fp32 gradient buffer of one bucket each;
  ``actor.param_offload`` (FSDP2) steps on the host too.
- **Nothing moves off the GPU between stages** (the loop never calls ``offload()``), but
  for the rollout's weight copy under ``rollout.release_weights``.
- **Rollout weights**: the engine reads the actor's own parameters only on one device, without
  FSDP, in the rollout's dtype, never generating over an update (async), and for LoRA with
  ``rollout.lora_in_place``; otherwise it holds a full bf16 copy (``workers/rollout.py``),
  held in every phase, or with ``rollout.release_weights`` in generation only: freed after
  it, allocated again at the weight sync after the optimizer step, when the GPU holds what
  it holds in generation less the KV cache and the engine's workspace: generation's peak
  bounds the sync's (whose transient buffers are not counted, with the key or without).
- **KV cache** (``engine/cache/sizing.make_cache``): paged (``kv_block_size``, the default) as
  many blocks as ``gpu_memory_utilization`` × free memory (the allocator's unused cache
  counted free) − the reserve for decode logits and prefill holds, at most ``max_num_seqs``
  sequences' worth, at least one sequence's (else the engine refuses); slots: up to
  ``max_num_seqs`` of ``max_seq_len``. Plus a scratch block or slot. With
  ``rollout.engine.kv_cache_dtype=fp8`` a position's K/V take 1 byte an element and an fp32
  scale a kv head (``engine/cache/fp8_kv.py``). ``rollout.release_cache``
  frees it (and the fused and fp8 weight copies of the triton path) after each generate.
- **Activations** at the micro-batch token budget, bf16, what autograd keeps per token and
  layer (see :func:`activation_bytes`); with gradient checkpointing each layer's input plus
  one layer recomputed in full. The log-prob head adds one 4096-token chunk of bf16 logits
  and an fp32 ``[V, H]`` gradient accumulator with its bf16 copy (``models/heads/logprobs.py``).
- Not counted: the CUDA context, cuBLAS/NCCL workspaces and allocator fragmentation (the fit
  check keeps :data:`HEADROOM_FRACTION` and :data:`HEADROOM_BYTES` free for them), the
  no-grad forwards of the log-prob, reference and value passes (their token budgets are
  chosen to fit: ``trainer/plan/memory_choices.py``), and the batch tensors.

Checked against ``max_memory_allocated`` of measured runs: docs/memory.md. The table and
the fit verdict: ``trainer/plan/memory_render.py``. The phases, options and item types:
``trainer/plan/memory_items.py``; the rollout's items and the KV cache: ``trainer/plan/memory_rollout.py``.
"""

from __future__ import annotations

import dataclasses

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.trainer.plan.memory_activations import (  # noqa: F401 (this module's names too)
    LOGPROB_CHUNK_TOKENS,
    activation_bytes_per_token,
    largest_layer_activation_elements,
    layer_activation_elements,
    logprob_head_bytes,
)
from hybridflow.trainer.plan.memory_items import (  # noqa: F401 (this module's names too)
    ALWAYS,
    CRITIC,
    GENERATE,
    GIB,
    HEADROOM_BYTES,
    HEADROOM_FRACTION,
    LORA_TARGET_SHAPES,
    PHASES,
    STEP,
    UPDATE,
    MemoryItem,
    MemoryPlan,
    PlanOptions,
    dtype_name,
)
from hybridflow.trainer.plan.memory_rollout import (  # noqa: F401 (this module's names too)
    ROLLOUT_WORKSPACE,
    fused_copy_bytes,
    kv_block_bytes,
    kv_cache_entries,
    kv_cache_item,
    kv_slot_bytes,
    rollout_items,
    rollout_reserve_bytes,
    rollout_shares_actor_weights,
)
from hybridflow.trainer.plan.memory_vision import (
    encoder_parameters,
    trained_encoder_parameters,
    vision_items,
)

OFFLOAD_BUCKET_ELEMENTS = 64 * 2**20
"""Parameters per bucket of the host step (``learners/host_optimizer.BUCKET_ELEMENTS``)."""


# ---------------------------------------------------------------------- parameter counts


def linear_parameters(a: ModelArchitecture) -> int:
    """Weights (and biases) of the decoder layers' linear projections: what autocast casts
    (MLA: q_a/q_b or q, kv_a, kv_b and o, without their norms)."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    per_layer = a.hidden_size * (2 * q + 2 * kv)
    if a.attention_bias:
        per_layer += q + 2 * kv
    if a.o_proj_bias:
        per_layer += a.hidden_size
    mla = a.mixer_parameters("mla") - (a.q_lora_rank or 0) - a.kv_lora_rank if a.kv_lora_rank else 0
    mixers = sum(mla if spec.mixer == "mla" else per_layer for spec in a.layer_specs())
    return mixers + a.mlp_parameters()  # every expert is cast


# Target names that give every routed expert its own factors (learners/lora.EXPERT_TARGETS).
LORA_EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj", "experts")


def lora_parameters(a: ModelArchitecture, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter weights of the whole model (:func:`lora_parameter_parts`, both parts)."""
    return sum(lora_parameter_parts(a, rank, targets))


def lora_parameter_parts(
    a: ModelArchitecture, rank: int, targets: tuple[str, ...]
) -> tuple[int, int]:
    """(peft's adapters, the routed experts' factors): rank × (in + out) for every targeted
    projection of every layer (:func:`lora_projections`: a mixer adapts its own projections
    in place of attention's, models/layer_spec.lora_target_modules), and for each routed
    expert rank × (in + out) of gate_up and down when an MLP projection (or ``experts``) is
    targeted (learners/lora.py). Expert parallelism splits the second part with the experts."""
    from hybridflow.models.layer_spec import lora_target_modules

    h, inner = a.hidden_size, a.moe_intermediate_size
    adapted = expert = 0
    for spec in a.layer_specs():
        names = set(lora_target_modules([spec], list(targets)))
        shapes = lora_projections(a, spec)
        adapted += sum(rank * sum(shape) for name, shape in shapes.items() if name in names)
        if spec.sparse and any(t in LORA_EXPERT_TARGETS for t in targets):
            # per-expert factors of gate_up [in h, out 2I] and down [in I, out h]
            expert += a.num_experts * rank * ((h + 2 * inner) + (inner + h))
    return adapted, expert


def lora_projections(a: ModelArchitecture, spec) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer LoRA may adapt in a decoder layer of kind ``spec``, by
    module name: the mixer's projections (MLA's q through its rank or direct, kv_a, kv_b, o;
    attention's q/k/v/o otherwise), the dense MLP's or the shared experts' gate/up/down."""
    h, heads = a.hidden_size, a.num_attention_heads
    if spec.mixer == "mla":
        qk = heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        rank = a.q_lora_rank
        shapes = {"q_proj": (h, qk)} if rank is None else {"q_a_proj": (h, rank),
                                                           "q_b_proj": (rank, qk)}  # fmt: skip
        shapes.update(kv_a_proj_with_mqa=(h, a.kv_lora_rank + a.qk_rope_head_dim),
                      kv_b_proj=(a.kv_lora_rank, heads * (a.qk_nope_head_dim + a.v_head_dim)),
                      o_proj=(heads * a.v_head_dim, h))  # fmt: skip
    else:
        q, kv = heads * a.head_dim, a.num_key_value_heads * a.head_dim
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    width = {"dense": a.intermediate_size, "experts_shared": a.shared_expert_intermediate_size,
             "grouped_experts_shared": a.moe_intermediate_size * a.n_shared_experts}  # fmt: skip
    if width.get(spec.mlp):
        inner = width[spec.mlp]
        shapes.update(gate_proj=(h, inner), up_proj=(h, inner), down_proj=(inner, h))
    return shapes


def lora_rank_parameters(a: ModelArchitecture, options: PlanOptions) -> int:
    """Adapter weights one training rank computes with once FSDP2 gathers them: 1/tp of
    peft's, 1/(tp × ep) of the routed experts' (split with their experts)."""
    adapted, expert = lora_parameter_parts(a, options.lora_rank, options.lora_targets)
    return adapted // options.tp + expert // (options.tp * options.ep)


def trainable_parameters(a: ModelArchitecture, options: PlanOptions) -> int:
    if options.lora_rank > 0:
        return lora_parameters(a, options.lora_rank, options.lora_targets)
    frozen = encoder_parameters(a) - trained_encoder_parameters(a, options)
    return a.num_parameters() - frozen


def rank_parameters(a: ModelArchitecture, tp: int = 1, ep: int = 1) -> int:
    """Parameters one training rank computes with once FSDP2 gathers them: 1/tp of every
    layer and of the vocabulary, 1/(tp × ep) of the routed experts."""
    from hybridflow.models.plan_shapes import shape_of

    total, routed = a.num_parameters(), shape_of(a).routed_params if a.is_moe else 0
    return (total - routed) // tp + routed // (tp * ep)


def gathered_unit_parameters(a: ModelArchitecture, tp: int = 1, ep: int = 1) -> int:
    """The largest unit FSDP2 gathers at once on a rank: a decoder layer's share, or the
    vocabulary's (embedding, lm_head)."""
    from hybridflow.models.plan_shapes import shape_of
    from hybridflow.trainer.plan.parallel_plan import layer_share

    s = shape_of(a)
    kinds = [sparse for sparse in (False, True) if (s.sparse_layers if sparse else s.dense_layers)]
    unit = max(layer_share(s, tp, ep, sparse) for sparse in kinds)
    return max(unit, s.embedding_params // tp)


def host_step_bucket(a: ModelArchitecture, options: PlanOptions) -> int:
    """Parameters in the largest bucket of the host step: the bucket size, or the largest
    trained tensor when it is larger (the [V, H] embedding, an MLP matrix), at most all."""
    widest = max(a.intermediate_size, 2 * a.moe_intermediate_size * max(a.num_experts, 1))
    if options.lora_rank > 0:
        largest = max(options.lora_rank * max(a.hidden_size, widest), 1)
    else:  # the embedding, a dense MLP matrix or a layer's packed gate_up experts [E, 2I, H]
        largest = max(a.vocab_size, widest) * a.hidden_size
    return min(trainable_parameters(a, options), max(OFFLOAD_BUCKET_ELEMENTS, largest))


# ---------------------------------------------------------------------- the plan


def actor_items(a: ModelArchitecture, o: PlanOptions) -> list[MemoryItem]:
    """Master weights, compute copy, gradients, AdamW state, activations, log-prob head."""
    items = host_step_items(a, o) if o.host_step else device_step_items(a, o)
    tokens = o.micro_batch_tokens
    checkpointed = ", checkpointed" if o.gradient_checkpointing else ""
    compiled = ", compiled" if o.compiled_layers else ""
    activations = tokens * activation_bytes_per_token(a, o.gradient_checkpointing, o.compute_bytes,
                                                      o.tp, o.compiled_layers)  # fmt: skip
    items.append(MemoryItem(f"activations ({tokens:,} tokens{checkpointed}{compiled})", activations,
                            (UPDATE,)))  # fmt: skip
    head = logprob_head_bytes(a, tokens, o.compute_bytes, o.tp)
    if o.lora_rank > 0:  # a frozen lm_head: no [V, H] gradient
        head = min(tokens, LOGPROB_CHUNK_TOKENS) * (a.vocab_size // o.tp) * o.compute_bytes
    items.append(MemoryItem("log-prob head (logits chunk, lm_head gradient)", head, (UPDATE,)))
    return items + vision_items(a, o)


def compute_copy_item(a: ModelArchitecture, o: PlanOptions) -> MemoryItem:
    """Autocast's bf16 casts of the fp32 layer weights and the lm_head, kept for the backward
    (1/tp of them on a tensor-parallel rank)."""
    linear = linear_parameters(a) + encoder_parameters(a)  # the encoder's projections too
    copy = (linear + a.vocab_size * a.hidden_size) // o.tp * o.compute_bytes
    return MemoryItem(f"actor compute copy ({dtype_name(o.compute_bytes)})", copy, (UPDATE,))


def host_step_items(a: ModelArchitecture, o: PlanOptions) -> list[MemoryItem]:
    """``optimizer_offload`` on one GPU (learners/host_optimizer): trained weights in bf16 on
    the GPU, their masters and AdamW state on the host, gradients freed bucket by bucket as
    the host takes them; frozen weights (LoRA's base) stay in the training dtype."""
    total, trainable = a.num_parameters(), trainable_parameters(a, o)
    # the host's masters are the trained tensors in their own dtype: LoRA adapters are fp32
    master_bytes = o.trained_state_bytes
    master = dtype_name(master_bytes)
    if o.lora_rank > 0:  # the frozen base stays in the training dtype; adapters come on top
        items = [
            MemoryItem(f"actor base weights ({dtype_name(o.master_bytes)}, frozen)",
                       total * o.master_bytes, ALWAYS),
            MemoryItem(f"actor LoRA adapters ({dtype_name(o.compute_bytes)}, masters on the "
                       "host)", trainable * o.compute_bytes, ALWAYS),
        ]  # fmt: skip
    else:
        items = [MemoryItem(f"actor weights ({dtype_name(o.compute_bytes)}, masters on the host)",
                            total * o.compute_bytes, ALWAYS)]  # fmt: skip
    items.append(MemoryItem(f"actor master weights ({master})", 0, (),
                            host_bytes=trainable * master_bytes))  # fmt: skip
    if o.lora_rank > 0 and o.mixed_precision:  # autocast still casts the fp32 base
        items.append(compute_copy_item(a, o))
    items += [
        MemoryItem(f"actor gradients ({dtype_name(o.compute_bytes)})", trainable * o.compute_bytes,
                   (UPDATE, STEP), note="freed bucket by bucket in the step"),
        MemoryItem(f"optimizer state (AdamW, {master})", 0, (),
                   host_bytes=trainable * 2 * master_bytes, note="steps on the host"),
        MemoryItem(f"host step buffers (2 pinned {dtype_name(o.compute_bytes)} + {master} gradients)",
                   0, (), host_bytes=host_step_bucket(a, o) * (2 * o.compute_bytes + master_bytes)),
    ]  # fmt: skip
    return items


def device_step_items(a: ModelArchitecture, o: PlanOptions) -> list[MemoryItem]:
    """Masters, compute copy, gradients and AdamW state on the GPU (sharded by FSDP2)."""
    total, trainable, ranks = a.num_parameters(), trainable_parameters(a, o), o.train_gpus
    on_host = o.param_offload and o.sharded  # FSDP2 CPUOffloadPolicy; one GPU ignores it
    master = total * o.master_bytes // ranks
    kind = "masters" if o.mixed_precision else "weights"
    items = [
        MemoryItem(f"actor weights ({dtype_name(o.master_bytes)} {kind})", 0 if on_host else master,
                   ALWAYS, host_bytes=master * o.gpus_per_host if on_host else 0,
                   note=f"sharded over {ranks} GPUs" if o.sharded else ""),
    ]  # fmt: skip
    state_bytes = o.trained_state_bytes  # LoRA's fp32 adapters, else the masters' dtype
    lora = trainable if o.lora_rank > 0 else 0  # adapters beside the base, not part of it
    if lora:  # 2.6 B parameters at rank 64 on every expert of Qwen3-30B-A3B: 9.6 GiB in fp32
        items.append(MemoryItem(f"actor LoRA adapters ({dtype_name(state_bytes)})",
                                lora * state_bytes // ranks, ALWAYS,
                                note=f"sharded over {ranks} GPUs" if o.sharded else ""))  # fmt: skip
    gathered_bytes = o.compute_bytes if o.mixed_precision else o.master_bytes
    lora_on_rank = lora_rank_parameters(a, o) if lora else 0
    on_rank = rank_parameters(a, o.tp, o.ep) + lora_on_rank  # a rank's share, gathered
    if o.layer_by_layer:  # ZeRO-3: a layer computing, the next prefetched
        unit = gathered_unit_parameters(a, o.tp, o.ep)
        items += [
            MemoryItem(f"actor gathered layers (2 in flight, {dtype_name(gathered_bytes)})",
                       2 * unit * gathered_bytes, (UPDATE,), note="FSDP2, layer by layer"),
            MemoryItem("actor one layer's gradients before reduce-scatter",
                       unit * state_bytes, (UPDATE,)),
        ]  # fmt: skip
    elif o.sharded:  # FSDP2 keeps every unit gathered for the mini-batch
        items.append(MemoryItem(f"actor gathered weights ({dtype_name(gathered_bytes)})",
                                on_rank * gathered_bytes, (UPDATE,)))  # fmt: skip
    elif o.mixed_precision:  # autocast's casts, kept for the backward; the lm_head cast
        items.append(compute_copy_item(a, o))
    gradients, state_dtype = trainable * state_bytes // ranks, dtype_name(state_bytes)
    accumulating = o.sharded and o.micro_batches > 1 and not o.layer_by_layer
    # Accumulating FSDP2 gradients stay unsharded (fp32) until the last micro-batch's
    # backward reduce-scatters them, layer by layer: the sharded ones replace them.
    items.append(MemoryItem(f"actor gradients ({state_dtype})",
                            0 if on_host else gradients, (STEP,) if accumulating else (UPDATE, STEP),
                            host_bytes=gradients * o.gpus_per_host if on_host else 0))  # fmt: skip
    if accumulating:
        unsharded = on_rank if o.lora_rank == 0 else lora_on_rank
        items.append(MemoryItem("actor unsharded gradients (accumulating)",
                                unsharded * state_bytes, (UPDATE,),
                                note="until the last micro-batch"))  # fmt: skip
    state = trainable * 2 * state_bytes // ranks
    name = f"optimizer state (AdamW, {state_dtype})"
    if on_host:
        items.append(MemoryItem(name, 0, (), host_bytes=state * o.gpus_per_host,
                                note="steps on the host"))  # fmt: skip
    else:
        items.append(MemoryItem(name, state, ALWAYS))
    return items


def reference_items(a: ModelArchitecture, o: PlanOptions) -> list[MemoryItem]:
    if o.reference == "none":
        return []
    if o.reference == "actor":
        return [MemoryItem("reference weights", 0, ALWAYS, note="the actor, adapters off")]
    on_host = o.reference_offload and o.sharded
    weights = a.num_parameters() * o.reference_bytes // o.train_gpus
    return [MemoryItem(f"reference weights ({dtype_name(o.reference_bytes)})",
                       0 if on_host else weights, ALWAYS,
                       host_bytes=weights * o.gpus_per_host if on_host else 0)]  # fmt: skip


def reward_model_items(o: PlanOptions) -> list[MemoryItem]:
    """A full copy of the reward model on each training GPU (workers/reward_model.py; not
    sharded); offloaded, it is on the GPU only while it scores, after generation and
    before the passes, a phase whose peak is below the update's."""
    if not o.reward_model_parameters:
        return []
    weights = o.reward_model_parameters * o.reward_model_bytes
    name = f"reward model weights ({dtype_name(o.reward_model_bytes)})"
    if o.reward_model_offload:
        return [MemoryItem(name, 0, ALWAYS, host_bytes=weights * o.gpus_per_host,
                           note="on the GPU only while it scores")]  # fmt: skip
    return [MemoryItem(name, weights, ALWAYS)]


def critic_items(a: ModelArchitecture, o: PlanOptions) -> list[MemoryItem]:
    """The value model: the actor's shapes, its own masters and AdamW state, an untied
    lm_head frozen (learners/modules.ValueModel); no LoRA, no offload, no checkpointing."""
    if not o.critic:
        return []
    total, ranks = a.num_parameters(), o.train_gpus
    frozen = 0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size
    trainable = total - frozen + a.hidden_size + 1
    tokens = o.critic_micro_batch_tokens
    copy = linear_parameters(a) * o.compute_bytes if o.mixed_precision else 0
    if o.sharded:  # a rank's share gathered for the mini-batch, like the actor's
        copy = rank_parameters(a, o.tp, o.ep) * (o.compute_bytes if o.mixed_precision
                                                 else o.master_bytes)  # fmt: skip
    activations = tokens * activation_bytes_per_token(a, False, o.compute_bytes, o.tp)
    return [
        MemoryItem(f"critic weights ({dtype_name(o.master_bytes)})",
                   total * o.master_bytes // ranks, ALWAYS),
        MemoryItem("critic optimizer state (AdamW)", trainable * 2 * o.master_bytes // ranks,
                   ALWAYS),
        MemoryItem("critic gradients", trainable * o.master_bytes // ranks, (CRITIC,)),
        MemoryItem("critic compute copy", copy, (CRITIC,)),
        MemoryItem(f"critic activations ({tokens:,} tokens)", activations, (CRITIC,)),
    ]  # fmt: skip


def build_plan(model: str, a: ModelArchitecture, o: PlanOptions) -> MemoryPlan:
    """Every item of the run on one training GPU (and one rollout GPU with split placement)."""
    items = actor_items(a, o) + reference_items(a, o) + reward_model_items(o)
    items += critic_items(a, o) + rollout_items(a, o)
    kv, slots, rows = kv_cache_item(a, o, items)
    if rows < o.rollout_max_seqs:  # capped slots: the workspace of the rows they decode
        items = [dataclasses.replace(i, gpu_bytes=rollout_reserve_bytes(a, o, rows))
                 if i.name == ROLLOUT_WORKSPACE else i for i in items]  # fmt: skip
    items.append(kv)
    if o.split:  # actor.full_weights(): the masters, on the controller's host, each sync
        items.append(MemoryItem("weights sent to the rollout (controller)", 0, (),
                                host_bytes=a.num_parameters() * o.master_bytes))  # fmt: skip
    return MemoryPlan(model, a, o, items, kv_slots=slots)
