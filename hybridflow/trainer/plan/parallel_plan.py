"""The per-GPU shares of a multi-GPU layout, for the memory plan (memory_plan.py, the one
model of a run's memory) and the reshard line of ``hybridflow config plan``.

Pure arithmetic on a :class:`~hybridflow.models.plan_shapes.PlanShape`:

- **A training rank** computes with 1/tp of each layer and 1/(tp × ep) of its experts once
  FSDP2 gathers it (:func:`layer_share`).
- **The rollout** holds 1/tp of each layer and of the vocabulary, its experts split over the
  tp ranks or whole on every rank (:func:`rollout_share`); its KV cache is split by KV heads
  (replicated where tp exceeds them; whole on every rank for a latent cache, MLA).
- **The reshard** between the two moves a GPU's rollout shard less the 1/world of it that
  its own training shard holds (:func:`reshard`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.models.plan_shapes import PlanShape

GPUS_PER_NODE = 8
NVLINK_BYTES_PER_S = 450e9
"""One direction of an H100/H200's NVLink (900 GB/s both ways): the reshard inside a node."""
NETWORK_BYTES_PER_S = 50e9
"""A 400 Gb/s InfiniBand or RoCE link per GPU: the reshard when the layout spans nodes."""


def layer_share(s: PlanShape, tp: int, ep: int, sparse: bool) -> int:
    """Parameters of one decoder layer a GPU computes with once FSDP2 gathers it."""
    if not sparse:
        return (s.attention_params + s.dense_mlp_params) // tp
    return (s.attention_params + s.shared_params) // tp + s.experts * s.expert_params // (tp * ep)


def rollout_share(s: PlanShape, tp: int, ep: int, experts_whole: bool = False) -> int:
    """Parameters of the rollout's copy on one GPU: 1/tp of every layer and of the vocabulary
    but what every rank holds whole (norms, routers, MLA's latent projection: rollout_whole);
    the experts 1/ep (whole experts; ep unset: over the tp ranks), or all of them on every
    rank (``experts_whole``: rollout.expert_parallel_size=1)."""
    split = (s.layers * s.attention_params + s.dense_layers * s.dense_mlp_params
             + s.sparse_layers * s.shared_params + s.embedding_params - s.rollout_whole)  # fmt: skip
    dense = split // tp + s.rollout_whole
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


@dataclass(frozen=True)
class Reshard:
    bytes_in: int
    """Bytes one GPU receives per sync."""
    seconds: float
    link: str


def reshard(s: PlanShape, world: int, rollout_tp: int, experts_whole: bool = False,
            rollout_bytes: int = 2, rollout_gpus: int = 0,
            moved: int | None = None, rollout_ep: int = 1) -> Reshard:  # fmt: skip
    """What a sync moves into one rollout GPU. ``moved``: the bytes, block by block, where
    known (parallel/reshard_plan.reshard_traffic); else estimated: its rollout shard, less
    the 1/world of it its own training shard holds when colocated (``rollout_gpus`` 0; FSDP2
    spreads every weight over all the training GPUs, so the rest comes from the others)."""
    shard = rollout_share(s, rollout_tp, rollout_ep, experts_whole) * rollout_bytes
    if moved is None:
        moved = shard - shard // world if not rollout_gpus else shard
    inside = world + rollout_gpus <= GPUS_PER_NODE
    speed, link = (NVLINK_BYTES_PER_S, "NVLink") if inside else (NETWORK_BYTES_PER_S, "network")
    return Reshard(moved, moved / speed, f"{link}, {speed / 1e9:.0f} GB/s a GPU")
