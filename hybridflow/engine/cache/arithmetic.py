"""The cache's sizes as plain arithmetic on the model's shape, without torch: the engine
(sizing.make_cache, engine.py) and the memory plan (trainer/plan/memory_rollout.py, which
`hybridflow config` commands run) size the cache with the same functions."""

from __future__ import annotations

SCALE_BYTES = 4  # one fp32 scale per position and kv head


def fp8_kv_bytes_per_position(layers: int, kv_heads: int, head_dim: int) -> int:
    """What one position takes in ``layers`` layers of an FP8 cache: K's and V's e4m3 values
    (1 byte an element) and their fp32 scale a kv head; head_dim + 4 bytes a head where bf16
    takes 2 × head_dim. The engine's allocation (sizing.make_cache) and the memory plan
    (trainer/plan/memory_rollout.py) both price it here."""
    return 2 * layers * kv_heads * (head_dim + SCALE_BYTES)


def ring_length(window: int, max_seq_len: int) -> int:
    """Entries a sliding layer's ring keeps a sequence: its last ``window`` positions, or
    all of them where a sequence of at most max_seq_len never fills the window."""
    return min(window, max_seq_len)


# Kinds the fused decode layers (layers/split.py, chain.py, lean.py) also run; a model with
# any other runs the eager passes (the model's own modules) on every backend.
FUSED_MIXERS = ("attention",)
FUSED_MLPS = ("dense", "experts")


def eager_only(specs) -> bool:
    """Whether a model of these layer specs needs the eager passes (a kind the fused decode
    layers do not cover: gated attention, Gated DeltaNet, a shared expert)."""
    return any(spec.mixer not in FUSED_MIXERS or spec.mlp not in FUSED_MLPS for spec in specs)


def whole_sequence_slots(budget: int, state_bytes: int, block_bytes: int,
                         blocks_per_sequence: int) -> int:  # fmt: skip
    """The most slots S whose per-sequence kinds ((S + 1) of them, the scratch slot's too)
    and the K/V blocks of S whole sequences (S x blocks_per_sequence, and the scratch block)
    fit ``budget`` bytes; >= 0. Beside a paged cache every slot's state is allocated up
    front, so slots beyond S leave fewer whole sequences held at once."""
    sequence = state_bytes + blocks_per_sequence * block_bytes
    return max((budget - state_bytes - block_bytes) // sequence, 0)


def state_slots(max_batch_size: int, budget: int | None, state_bytes: int, block_bytes: int,
                blocks_per_sequence: int, cap: bool = True, row_bytes: int = 0) -> int:  # fmt: skip
    """Slots of a paged cache with per-sequence kinds of ``state_bytes`` a slot: at most
    max_batch_size, capped (``cap``) at whole_sequence_slots where the budget (bytes; None:
    unbounded) does not hold max_batch_size whole sequences, at least one (the blocks'
    sizing then names what a sequence needs). The engine (make_cache) and the memory plan
    (trainer/plan/memory_rollout.py) both size the slots here.

    ``row_bytes``: the workspace each decoded row reserves outside the cache (its sampling:
    workspace.sampling_bytes_per_row), already taken out of ``budget`` for max_batch_size
    rows. Capped slots decode fewer rows, so the rows they drop give their workspace back to
    the cache: a slot then costs its state, its blocks and its row."""
    if budget is None or not cap or not state_bytes:
        return max_batch_size
    whole = whole_sequence_slots(budget + max_batch_size * row_bytes, state_bytes + row_bytes,
                                 block_bytes, blocks_per_sequence)  # fmt: skip
    return max(min(max_batch_size, whole), 1)
