"""The memory plan of a multi-GPU layout: bytes per GPU of each role, phase by phase, for
tensor, sequence and expert parallel training and a tensor-parallel rollout.

Pure arithmetic on a :class:`~hybridflow.models.plan_shapes.PlanShape` and a
:class:`ParallelSetup`. What it assumes (the layouts of docs/parallelism.md):

- **Training state** is sharded over every training GPU: tensor parallelism splits each
  layer (experts too), FSDP2 shards what is left over dp × sp, and expert parallelism spreads
  the experts over ep of those ranks while FSDP2 shards each expert over the others, so a GPU
  holds 1/world of the masters, gradients and AdamW state (the replicated norms are ignored).
  With ``param_offload`` they are on the host (FSDP2's CPU offload).
- **FSDP2 gathers layer by layer** (ZeRO-3): two layers in flight in the compute dtype (one
  computing, one prefetched) and one layer's unsharded gradients before the reduce-scatter.
  A GPU's share of a gathered layer is 1/tp of its dense weights and 1/(tp × ep) of its
  experts.
- **Activations** at the micro-batch token budget of one GPU, as trainer/plan/memory_activations.py
  counts them, with the head-, MLP- and expert-wide tensors divided by tp (the residual
  stream is not). Ulysses keeps the budget per GPU: a sequence of up to budget × sp tokens
  is split over the sp ranks. The vocabulary-parallel log-prob head holds 1/tp of the logits
  and of the lm_head gradient.
- **The rollout** holds its own copy of the weights for the whole run: 1/tp of each layer per
  GPU, 1/ep of the experts with rollout expert parallelism; its KV cache is split by KV heads
  (replicated where tp exceeds them; whole on every rank for a latent cache, MLA), sized from
  ``gpu_memory_utilization`` of the memory free at generation, as the engine sizes it.
- **The reshard** between the two moves the weights bucket by bucket: a transient of
  :data:`RESHARD_BUCKET_BYTES` on top of what both hold; a GPU receives its rollout shard
  less the 1/world of it that its own training shard holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.models.plan_shapes import PlanShape
from hybridflow.trainer.plan.memory_activations import LOGPROB_CHUNK_TOKENS
from hybridflow.trainer.plan.memory_plan import CRITIC, GENERATE, STEP, UPDATE, MemoryItem

SYNC = "weight sync"
PHASES = (SYNC, GENERATE, UPDATE, STEP, CRITIC)

RESHARD_BUCKET_BYTES = 2**30
"""Bytes of one bucket of the training-to-rollout reshard: its transient memory."""

GPUS_PER_NODE = 8
NVLINK_BYTES_PER_S = 450e9
"""One direction of an H100/H200's NVLink (900 GB/s both ways): the reshard inside a node."""
NETWORK_BYTES_PER_S = 50e9
"""A 400 Gb/s InfiniBand or RoCE link per GPU: the reshard when the layout spans nodes."""


@dataclass(frozen=True)
class ParallelSetup:
    """A run as the parallel plan sees it; sizes are per GPU unless named otherwise."""

    gpu_bytes: int
    world: int
    """Training GPUs (all of them when colocated)."""
    tp: int = 1
    sp: int = 1
    ep: int = 1
    rollout_tp: int = 1
    rollout_ep: int = 1
    rollout_experts_whole: bool = False
    """rollout.expert_parallel_size=1 with rollout tp > 1: every rank holds every expert
    (else the experts split over the tp ranks, or over ep ranks when larger)."""
    rollout_gpus: int = 0
    """0: the rollout is colocated on the training GPUs; else GPUs of its own."""
    master_bytes: int = 4
    """Trained weights, gradients and AdamW moments: fp32 (model.dtype=auto) or bf16."""
    compute_bytes: int = 2
    rollout_bytes: int = 2
    param_offload: bool = False
    gradient_checkpointing: bool = False
    micro_batch_tokens: int = 16384
    """Tokens of one actor micro-batch on one GPU (actor.max_tokens_per_gpu)."""
    max_seq_len: int = 2048
    samples_per_step: int = 1024
    rollout_max_seqs: int = 1024
    gpu_memory_utilization: float = 0.9
    max_prefill_tokens: int = 16384
    reference: bool = False
    critic: bool = False

    @property
    def colocated(self) -> bool:
        return self.rollout_gpus == 0

    @property
    def rollout_world(self) -> int:
        return self.world if self.colocated else self.rollout_gpus

    @property
    def replicas(self) -> int:
        return self.rollout_world // self.rollout_tp


def run_phases(o: ParallelSetup) -> tuple[str, ...]:
    """The phases of this run (the critic's only with a critic); training state stays on
    its GPUs through all of them (nothing is moved off between them)."""
    return tuple(p for p in PHASES if p != CRITIC or o.critic)


def _dtype(element_bytes: int) -> str:
    return {4: "fp32", 2: "bf16", 1: "fp8"}.get(element_bytes, f"{element_bytes}-byte")


# ---------------------------------------------------------------------- per-GPU shares


def layer_share(s: PlanShape, tp: int, ep: int, sparse: bool) -> int:
    """Parameters of one decoder layer a GPU computes with once FSDP2 gathers it."""
    if not sparse:
        return (s.attention_params + s.dense_mlp_params) // tp
    return (s.attention_params + s.shared_params) // tp + s.experts * s.expert_params // (tp * ep)


def rollout_share(s: PlanShape, tp: int, ep: int, experts_whole: bool = False) -> int:
    """Parameters of the rollout's copy on one GPU: 1/tp of every layer and of the vocabulary;
    the experts 1/ep (whole experts; ep unset: over the tp ranks), or all of them on every
    rank (``experts_whole``: rollout.expert_parallel_size=1)."""
    dense = (s.layers * s.attention_params + s.dense_layers * s.dense_mlp_params
             + s.sparse_layers * s.shared_params + s.embedding_params) // tp  # fmt: skip
    experts = s.routed_params // ep if ep > 1 else s.routed_params // tp
    if experts_whole:
        experts = s.routed_params
    return dense + experts


def kv_bytes_per_token(s: PlanShape, tp: int, element_bytes: int) -> int:
    """KV cache bytes of one token on one rollout GPU, every layer."""
    divisor = min(tp, s.kv_heads) if s.kv_cache_splits else 1
    layers = s.layers if s.kv_layers is None else s.kv_layers
    return layers * s.kv_cache_elements * element_bytes // divisor


def kv_bytes_per_sequence(s: PlanShape, tp: int, element_bytes: int, seq_len: int) -> int:
    """KV cache bytes of one sequence of seq_len tokens on one rollout GPU: the sliding-window
    layers hold a window's worth, the others every token."""
    per_token = kv_bytes_per_token(s, tp, element_bytes)
    if not s.window_layers:
        return per_token * seq_len
    layers = s.layers if s.kv_layers is None else s.kv_layers
    per_layer = per_token // layers
    windowed = s.window_layers * per_layer * min(seq_len, s.window)
    return (layers - s.window_layers) * per_layer * seq_len + windowed


def activation_elements(s: PlanShape, tp: int, checkpointing: bool) -> int:
    """Elements per token the backward keeps over all layers (memory_activations.py's count
    with the tensor-parallel widths divided by tp)."""
    h, attention = s.hidden, 4 * s.hidden + (2 * s.q_width + 2 * s.kv_width) // tp
    dense = attention + 4 * s.intermediate // tp
    sparse = (
        attention + s.experts_per_token * (4 * s.moe_intermediate // tp + 4 * h) + 3 * s.experts
    )
    head = 3 * h
    if checkpointing:  # each layer's input, one layer recomputed at a time
        return (
            s.layers * h
            + max(dense if s.dense_layers else 0, sparse if s.sparse_layers else 0)
            + head
        )
    return s.dense_layers * dense + s.sparse_layers * sparse + head


# ---------------------------------------------------------------------- items


def training_items(s: PlanShape, o: ParallelSetup, role: str = "actor") -> list[MemoryItem]:
    """One trained model (actor or critic) on one training GPU."""
    total, world, master = s.total_params, o.world, _dtype(o.master_bytes)
    shard = total // world
    offload = o.param_offload
    phase = (UPDATE, STEP) if role == "actor" else (CRITIC,)
    work = (UPDATE,) if role == "actor" else (CRITIC,)
    note = f"1/{world} of {total / 1e9:.1f} B parameters" + (", on the host" if offload else "")
    items = [
        MemoryItem(f"{role} weights ({master})", 0 if offload else shard * o.master_bytes,
                   run_phases(o), host_bytes=shard * o.master_bytes * world if offload else 0,
                   note=note),
        MemoryItem(f"{role} optimizer state (AdamW, {master})",
                   0 if offload else 2 * shard * o.master_bytes, run_phases(o),
                   host_bytes=2 * shard * o.master_bytes * world if offload else 0),
        MemoryItem(f"{role} gradients ({master})", 0 if offload else shard * o.master_bytes,
                   phase, host_bytes=shard * o.master_bytes * world if offload else 0),
    ]  # fmt: skip
    unit = max(layer_share(s, o.tp, o.ep, sparse) for sparse in (False, True)
               if (s.sparse_layers if sparse else s.dense_layers))  # fmt: skip
    unit = max(unit, s.embedding_params // o.tp)
    items += [
        MemoryItem(f"{role} gathered layers (2 in flight, {_dtype(o.compute_bytes)})",
                   2 * unit * o.compute_bytes, work, note="FSDP2, layer by layer"),
        MemoryItem(f"{role} one layer's gradients before reduce-scatter",
                   unit * o.master_bytes, work),
    ]  # fmt: skip
    tokens = o.micro_batch_tokens
    per_token = activation_elements(s, o.tp, o.gradient_checkpointing) * o.compute_bytes
    checkpointed = ", checkpointed" if o.gradient_checkpointing else ""
    items.append(MemoryItem(f"{role} activations ({tokens:,} tokens{checkpointed})",
                            tokens * per_token, work))  # fmt: skip
    if role == "actor":
        vocab = s.vocab // o.tp
        head = min(tokens, LOGPROB_CHUNK_TOKENS) * vocab * o.compute_bytes
        head += vocab * s.hidden * (4 + o.compute_bytes)  # the lm_head gradient accumulator
        items.append(MemoryItem("log-prob head (logits chunk, lm_head gradient)", head, work,
                                note=f"1/{o.tp} of the vocabulary" if o.tp > 1 else ""))  # fmt: skip
    return items


def reference_item(s: PlanShape, o: ParallelSetup) -> MemoryItem:
    shard = s.total_params * o.compute_bytes // o.world
    return MemoryItem(f"reference weights ({_dtype(o.compute_bytes)})", shard, run_phases(o),
                      note=f"1/{o.world}, FSDP2")  # fmt: skip


def rollout_items(s: PlanShape, o: ParallelSetup) -> list[MemoryItem]:
    """The rollout's copy, the reshard bucket and the engine's workspace (the KV cache is
    sized from what is left: :func:`kv_cache`)."""
    on_own = not o.colocated
    weights = rollout_share(s, o.rollout_tp, o.rollout_ep, o.rollout_experts_whole)
    weights *= o.rollout_bytes
    held = run_phases(o) if o.colocated else (SYNC, GENERATE)
    layout = f"tp {o.rollout_tp}" + (f", ep {o.rollout_ep}" if o.rollout_ep > 1 else "")
    layout += ", experts whole" if o.rollout_experts_whole else ""
    vocab = s.vocab // o.rollout_tp
    workspace = o.rollout_max_seqs * vocab * 6  # decode logits (engine/engine._allocate)
    inner = max(s.intermediate, s.moe_intermediate * s.experts_per_token) // o.rollout_tp
    workspace += o.max_prefill_tokens * (4 * inner + 8 * s.hidden) * o.rollout_bytes
    return [
        MemoryItem(f"rollout weights ({_dtype(o.rollout_bytes)}, {layout})", weights, held,
                   rollout_gpu=on_own),
        MemoryItem("reshard bucket", RESHARD_BUCKET_BYTES, (SYNC,), rollout_gpu=on_own,
                   note="transient, one bucket"),
        MemoryItem("rollout workspace (decode logits, prefill)", workspace, (GENERATE,),
                   rollout_gpu=on_own),
    ]  # fmt: skip


@dataclass(frozen=True)
class KVCache:
    bytes: int
    sequences: int
    """Sequences of max_seq_len it holds at once on one replica (at most rollout_max_seqs)."""
    wave: int
    """Sequences a replica generates per step: samples_per_step / replicas."""


def kv_cache(s: PlanShape, o: ParallelSetup, used: int, workspace: int) -> KVCache:
    """The engine's KV cache: gpu_memory_utilization of what is free at generation, less the
    workspace, at most rollout_max_seqs sequences of max_seq_len."""
    per_sequence = kv_bytes_per_sequence(s, o.rollout_tp, o.rollout_bytes, o.max_seq_len)
    per_sequence += s.state_bytes  # recurrent layers: one state a sequence, whatever its length
    budget = int(o.gpu_memory_utilization * max(o.gpu_bytes - used, 0)) - workspace
    sequences = max(min(budget // per_sequence, o.rollout_max_seqs), 0)
    wave = -(-o.samples_per_step // o.replicas)
    return KVCache(sequences * per_sequence, sequences, wave)


@dataclass(frozen=True)
class Reshard:
    bytes_in: int
    """Bytes one GPU receives per sync."""
    seconds: float
    link: str


def reshard(s: PlanShape, o: ParallelSetup, moved: int | None = None) -> Reshard:
    """What a sync moves into one rollout GPU. ``moved``: the bytes, block by block, where
    known (parallel/reshard_plan.reshard_traffic: a dense model colocated); else estimated:
    its rollout shard, less the 1/world of it its own training shard holds when colocated
    (FSDP2 spreads every weight over all the training GPUs, so the rest comes from the
    others)."""
    shard = rollout_share(s, o.rollout_tp, o.rollout_ep, o.rollout_experts_whole)
    shard *= o.rollout_bytes
    if moved is None:
        moved = shard - shard // o.world if o.colocated else shard
    span = o.world if o.colocated else o.world + o.rollout_gpus
    inside = span <= GPUS_PER_NODE
    speed, link = (NVLINK_BYTES_PER_S, "NVLink") if inside else (NETWORK_BYTES_PER_S, "network")
    return Reshard(moved, moved / speed, f"{link}, {speed / 1e9:.0f} GB/s a GPU")


@dataclass
class ParallelPlan:
    shape: PlanShape
    setup: ParallelSetup
    items: list[MemoryItem]
    kv: KVCache
    reshard: Reshard

    @property
    def phases(self) -> tuple[str, ...]:
        return run_phases(self.setup)

    def phase_bytes(self, phase: str, rollout_gpu: bool = False) -> int:
        return sum(i.gpu_bytes for i in self.items
                   if phase in i.phases and i.rollout_gpu == rollout_gpu)  # fmt: skip

    def peak(self, rollout_gpu: bool = False) -> tuple[str, int]:
        """(phase, bytes) of the largest total on a training (or rollout) GPU."""
        totals = ((p, self.phase_bytes(p, rollout_gpu)) for p in self.phases)
        return max(totals, key=lambda t: t[1])

    def largest(self, phase: str, count: int = 3, rollout_gpu: bool = False) -> list[MemoryItem]:
        held = [i for i in self.items if phase in i.phases and i.rollout_gpu == rollout_gpu]
        return sorted(held, key=lambda i: -i.gpu_bytes)[:count]


def build_parallel_plan(s: PlanShape, o: ParallelSetup,
                        reshard_bytes: int | None = None) -> ParallelPlan:  # fmt: skip
    """Every item of the run on one training GPU (and one rollout GPU when not colocated).
    reshard_bytes: what a sync moves into a rollout GPU, where known (see reshard)."""
    items = training_items(s, o, "actor")
    if o.reference:
        items.append(reference_item(s, o))
    if o.critic:
        items += training_items(s, o, "critic")
    items += rollout_items(s, o)
    workspace = next(i.gpu_bytes for i in items if "workspace" in i.name)
    used = sum(i.gpu_bytes for i in items if GENERATE in i.phases
               and i.rollout_gpu == (not o.colocated) and "workspace" not in i.name)  # fmt: skip
    cache = kv_cache(s, o, used, workspace)
    items.append(MemoryItem(f"KV cache ({cache.sequences:,} × {o.max_seq_len:,} tokens a replica)",
                            cache.bytes, (GENERATE,), rollout_gpu=not o.colocated))  # fmt: skip
    return ParallelPlan(s, o, items, cache, reshard(s, o, reshard_bytes))
