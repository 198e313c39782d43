"""The rollout's items of the memory plan: its weight copy and fused decode copies, the
engine's reserve for decode logits and prefill, and the KV cache sized from what the other
items leave (engine/cache/kv_cache.py, engine/engine.py)."""

from __future__ import annotations

from hybridflow.engine.cache.arithmetic import (
    eager_only,
    fp8_kv_bytes_per_position,
    ring_length,
    state_slots,
)
from hybridflow.engine.cache.workspace import engine_workspace_bytes, sampling_bytes_per_row
from hybridflow.models.architecture import ModelArchitecture
from hybridflow.trainer.plan.memory_items import (
    ALWAYS,
    GENERATE,
    MemoryItem,
    PlanOptions,
    dtype_name,
)


def kv_slot_bytes(a: ModelArchitecture, max_seq_len: int, element_bytes: int = 2) -> int:
    """K and V (MLA: the latent) of one sequence of max_seq_len tokens in every layer that
    keeps them (engine/cache/kv_cache.py), a window's worth in sliding-window layers; a hybrid
    model's recurrent layers keep none (state_bytes)."""
    return a.cache_bytes_per_sequence(max_seq_len, element_bytes)


def kv_block_bytes(a: ModelArchitecture, block: int, element_bytes: int = 2,
                   fp8: bool = False) -> int:  # fmt: skip
    """K and V (MLA: the latent) of ``block`` positions of a paged cache's block: the layers
    that keep every position (a sliding layer keeps a ring a slot instead: per_sequence_bytes).
    fp8: an FP8 cache's e4m3 K/V and their scales (rollout.engine.kv_cache_dtype=fp8, which
    covers full-attention K/V only: validate refuses the other kinds)."""
    per_layer = a.cache_elements_per_token()
    kept = [s for s in a.layer_specs() if s.cache != "recurrent" and not s.window]
    if fp8:
        return fp8_kv_bytes_per_position(len(kept), a.num_key_value_heads, a.head_dim) * block
    return sum(per_layer[s.cache] for s in kept) * block * element_bytes


def per_sequence_bytes(a: ModelArchitecture, max_seq_len: int, element_bytes: int = 2,
                       tp: int = 1) -> int:  # fmt: skip
    """What a sequence of at most max_seq_len tokens keeps whatever its length on one rank of
    a ``tp``-rank rollout, one per slot beside a paged cache's blocks
    (engine/cache/sizing._PerSequence): its recurrent layers' state (recurrent_state_bytes)
    and its sliding layers' rings of a window's K/V, at most max_seq_len positions
    (engine/cache/arithmetic.py: ring_length; the rank's KV heads, kv_split)."""
    per_layer = a.cache_elements_per_token()
    rings = sum(per_layer[s.cache] * ring_length(s.window, max_seq_len) for s in a.layer_specs()
                if s.cache != "recurrent" and s.window)  # fmt: skip
    rings_bytes = rings * element_bytes // kv_split(a, tp)
    return recurrent_state_bytes(a, element_bytes, tp) + rings_bytes


def recurrent_state_bytes(a: ModelArchitecture, element_bytes: int = 2, tp: int = 1) -> int:
    """A sequence's recurrent state (conv + fp32 SSM) on one rank of a ``tp``-rank rollout:
    each rank keeps its Gated DeltaNet key heads' channels and value heads' state only
    (engine/tensor_parallel.py; tp divides the key heads, validate says so)."""
    return a.recurrent_state_bytes(element_bytes) // tp


def rollout_reserve_bytes(a: ModelArchitecture, options: PlanOptions,
                          rows: int | None = None) -> int:  # fmt: skip
    """What the engine keeps out of the KV budget for decode sampling, prefill activations
    and the experts' workspace (engine/allocation.py's reserve: the same function), for
    ``rows`` decoded at once (default max_num_seqs; fewer where the cache caps its slots)."""
    rows = options.rollout_max_seqs if rows is None else rows
    return engine_workspace_bytes(a, rows, options.max_prefill_tokens, options.rollout_bytes,
                                  options.rollout_tp)  # fmt: skip


ROLLOUT_WORKSPACE = "rollout workspace (decode logits, prefill)"


def kv_split(a: ModelArchitecture, tp: int) -> int:
    """Ranks of a tensor-parallel rollout that split a sequence's KV cache: its KV heads
    (replicated where tp exceeds them); MLA's latent is whole on every rank."""
    return 1 if a.kv_lora_rank else max(min(tp, a.num_key_value_heads), 1)


def rollout_weight_parameters(a: ModelArchitecture, o: PlanOptions) -> int:
    """Parameters of the engine's copy on one rollout GPU: all of them, or 1/tp of every
    layer and of the vocabulary with the experts split over the tp ranks (or whole on every
    rank: rollout.expert_parallel_size=1; or 1/ep of them, spread over several replicas)."""
    if o.rollout_tp == 1 and o.rollout_ep == 1:
        return a.num_parameters()
    from hybridflow.models.plan_shapes import shape_of
    from hybridflow.trainer.plan.parallel_plan import rollout_share

    return rollout_share(shape_of(a), o.rollout_tp, o.rollout_ep, o.rollout_experts_whole)


def fused_copy_bytes(a: ModelArchitecture, fuse_projections: str, element_bytes: int = 2) -> int:
    """The triton decode path's concatenated q/k/v (and gate/up) copies (engine/weights/fused.py);
    none for a model the engine runs on its eager passes (gated attention, Gated DeltaNet, a
    shared expert: engine/cache/kinds.eager_only), which decodes without them."""
    if fuse_projections == "none" or eager_only(a.layer_specs()):
        return 0
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    rows = q + 2 * kv
    per_layer = rows * a.hidden_size + (rows if a.attention_bias else 0)
    total = a.num_hidden_layers * per_layer
    if fuse_projections == "all":  # gate/up of the dense layers; experts are read in place
        dense = a.num_hidden_layers - len(a.sparse_layer_indices())
        total += dense * 2 * a.intermediate_size * a.hidden_size
    return total * element_bytes


def kv_budget(reserve: int, used: int, o: PlanOptions) -> int | None:
    """Bytes the engine's cache may take (sizing.cache_budget): gpu_memory_utilization of
    the memory the other items leave, minus the reserve; None: the GPU's size is unknown."""
    if o.gpu_bytes is None:
        return None
    return int(o.gpu_memory_utilization * max(o.gpu_bytes - used, 0)) - reserve


def kv_cache_entries(entry_bytes: int, most: int, reserve: int, used: int, o: PlanOptions) -> int:
    """Slots (sizing.plan_slots) or blocks (plan_blocks) the engine allocates: ``most``
    (max_num_seqs sequences' worth), or what kv_budget holds, one scratch entry taken out;
    >= 0. GPU size unknown: ``most``."""
    budget = kv_budget(reserve, used, o)
    if budget is None:
        return most
    return max(min(most, budget // entry_bytes - 1), 0)


def rollout_shares_actor_weights(o: PlanOptions) -> bool:
    """The engine runs on the actor's own tensors (workers/rollout.RolloutWorker)."""
    return (not o.split and not o.sharded and (o.lora_rank == 0 or o.lora_in_place)
            and not o.rollout_beside_update and o.trained_weight_bytes == o.rollout_bytes)  # fmt: skip


def rollout_items(a: ModelArchitecture, o: PlanOptions) -> list[MemoryItem]:
    """Weight copy, fused decode copies and the engine's reserve (the KV cache comes last:
    it is sized from what these leave)."""
    split = o.split
    if rollout_shares_actor_weights(o):
        weights = MemoryItem("rollout weights", 0, ALWAYS, note="reads the actor's in place")
    else:
        notes = [f"1/{o.rollout_tp}, tensor parallel"] if o.rollout_tp > 1 else []
        # freed after generation, back at the sync, when the GPU holds what it holds in
        # generation less the KV cache and the workspace (validate: sync mode, colocated)
        released = o.rollout_release_weights and not split
        notes += ["freed for the update (rollout.release_weights)"] if released else []
        weights = MemoryItem(f"rollout weights ({dtype_name(o.rollout_bytes)} copy)",
                             rollout_weight_parameters(a, o) * o.rollout_bytes,
                             (GENERATE,) if released else ALWAYS, rollout_gpu=split,
                             note="; ".join(notes))  # fmt: skip
    # a tensor-parallel shard's copies are of its heads and MLP columns
    fused = fused_copy_bytes(a, o.fuse_projections, o.rollout_bytes) // o.rollout_tp
    held = (GENERATE,) if o.release_cache else ALWAYS  # Engine.release() frees them
    # 1 byte each (engine/fp8/matmul.py; a mixture of experts' experts: fp8/experts.py)
    fp8 = a.num_parameters(include_embeddings=False) // o.rollout_tp
    fp8_copies = [MemoryItem("rollout fp8 projection copies", fp8, held, rollout_gpu=split)]
    return [
        weights,
        MemoryItem("rollout fused q/k/v, gate/up copies", fused, held, rollout_gpu=split),
        *(fp8_copies if o.rollout_fp8 else []),
        MemoryItem(ROLLOUT_WORKSPACE, rollout_reserve_bytes(a, o),
                   (GENERATE,), rollout_gpu=split),
    ]  # fmt: skip


def kv_cache_item(a: ModelArchitecture, o: PlanOptions, items: list[MemoryItem]):
    """(the KV-cache item, the sequences of max_seq_len it holds, the rows decoded at once),
    sized from the memory the other items leave on the rollout's GPU when generation starts.
    Rows below max_num_seqs (capped slots) reserve their sampling workspace no more: the
    cache has it, as the engine's (sizing.make_cache)."""
    reserve, length, block = rollout_reserve_bytes(a, o), o.rollout_max_seq_len, o.kv_block_size
    used = sum(i.gpu_bytes for i in items if GENERATE in i.phases and i.rollout_gpu == o.split
               and "workspace" not in i.name)  # fmt: skip
    per_sequence = 1 if block is None else -(-length // block)  # slots or blocks a sequence
    # a slot cache's slot: its K/V (a sliding layer's window of it) and its recurrent state;
    # beside a paged cache's blocks (the layers keeping every position), every slot's
    # per-sequence kinds (and the scratch one's) are taken first, the slots capped where
    # whole sequences fit fewer (sizing.state_slots, as the engine)
    if block is None:
        entry = kv_slot_bytes(a, length, o.rollout_bytes) // kv_split(a, o.rollout_tp)
        state = recurrent_state_bytes(a, o.rollout_bytes, o.rollout_tp)
    else:
        entry = kv_block_bytes(a, block, o.rollout_bytes, o.kv_cache_fp8) // kv_split(
            a, o.rollout_tp
        )
        state = per_sequence_bytes(a, length, o.rollout_bytes, o.rollout_tp)
    slots, row = o.rollout_max_seqs, sampling_bytes_per_row(a, o.rollout_tp)
    budget = kv_budget(reserve, used, o)  # max_num_seqs rows' workspace taken out
    if block is not None and state:
        slots = state_slots(slots, budget, state, entry, per_sequence, o.cap_state_slots, row)
        reserve = rollout_reserve_bytes(a, o, slots)
    states = 0 if block is None else (slots + 1) * state
    entry += state if block is None else 0
    entries = kv_cache_entries(entry, slots * per_sequence, reserve + states, used, o)
    sequences = entries // per_sequence  # the engine refuses 0 (no slot; not one sequence)
    name, note = f"KV cache ({entries:,} + 1 slots × {length:,} tokens)", ""
    none = f"KV cache (no slot of {length:,} tokens fits)"
    if block is not None:  # paged: how many sequences of max_seq_len its blocks hold
        name = f"KV cache ({entries:,} + 1 blocks: {sequences:,} × {length:,} tokens)"
        none = f"KV cache (no {length:,}-token sequence fits)"
        note = f"{block} tokens a block, {per_sequence:,} blocks a {length:,}-token sequence"
        if o.kv_cache_fp8:
            note = f"fp8 K/V (e4m3, a scale a kv head), {note}"
        if states:
            kind = "recurrent states" if a.recurrent_state_bytes() else "window rings"
            note += state_slots_note(o, slots, sequences, budget, state, entry, per_sequence,
                                     length, kind, row)  # fmt: skip
    phases = (GENERATE,) if o.release_cache else ALWAYS
    size = (entries + 1) * entry + states if sequences else 0
    return MemoryItem(name if sequences else none, size, phases, rollout_gpu=o.split,
                      note=note), sequences, slots  # fmt: skip


def state_slots_note(o: PlanOptions, slots: int, sequences: int, budget: int | None,
                     state: int, block: int, per_sequence: int, length: int,
                     kind: str, row: int) -> str:  # fmt: skip
    """What the paged cache's per-sequence ``kind`` takes, and where the slots were capped (or,
    with rollout.engine.cap_state_slots=false, the max_num_seqs that would hold the most
    whole sequences; ``row``: a decoded row's sampling workspace, state_slots')."""
    note = f"; {kind} of {slots + 1:,} slots, {(slots + 1) * state / 2**30:.1f} GiB"
    if slots < o.rollout_max_seqs:
        return note + (f": rollout.max_num_seqs={o.rollout_max_seqs:,} capped at {slots:,}, "
                       f"the most whole {length:,}-token sequences beside their states")  # fmt: skip
    whole = 0 if budget is None else state_slots(o.rollout_max_seqs, budget, state, block,
                                                 per_sequence, True, row)  # fmt: skip
    if sequences < whole < o.rollout_max_seqs:
        note += (f": rollout.engine.cap_state_slots=true (or rollout.max_num_seqs={whole:,}) "
                 f"holds {whole:,} {length:,}-token sequences at once")  # fmt: skip
    return note
