"""Two choices the memory plan makes for a run: gradient checkpointing
(``model.gradient_checkpointing=auto``) and the token budget of the forward-only log-prob
passes (``actor.log_prob_max_tokens_per_gpu`` and ``ref.max_tokens_per_gpu`` left null).

Pure arithmetic on a :class:`~hybridflow.trainer.plan.memory_plan.MemoryPlan`; the config side
(reading the keys, the log line) is ``trainer/plan/memory_check.memory_defaults``.

- **Checkpointing** costs a second forward of every layer in the backward (~30% more update
  compute), so ``auto`` turns it on only when the actor update would not fit without it:
  off when the update phase planned without checkpointing stays under
  ``1 - CHECKPOINTING_MARGIN`` of the usable GPU memory, on otherwise.
- **Forward budget.** The old-log-prob and reference passes run under ``torch.no_grad``
  (``learners/response_forward.py``): nothing is kept for a backward, so a token costs one
  layer's intermediates at a time instead of every layer's. The budget is the most tokens
  whose forward fits in what stays resident while it runs (the items held in every phase plus
  the actor's bf16 weight copy), at most ``FORWARD_BUDGET_CAP`` × the update's budget (past a
  few tens of thousands of tokens a forward is compute-bound and larger micro-batches stop
  paying) and at most the whole batch on one GPU; never below the update's budget, whose
  activations are larger than the forward's at the same size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_plan import MemoryPlan, PlanOptions
from hybridflow.trainer.plan.memory_render import usable_bytes

CHECKPOINTING_MARGIN = 0.10
"""Share of the usable memory the update must leave free for ``auto`` to keep checkpointing off
(the plan does not count allocator fragmentation beyond its headroom)."""

FORWARD_BUDGET_CAP = 4
"""Most tokens of a log-prob micro-batch, as a multiple of the update's token budget."""

BUDGET_STEP = 1024
"""A derived budget is rounded down to a multiple of this."""

WEIGHT_COPIES = ("actor compute copy", "actor gathered weights")
"""Plan items (by name) alive through a forward too: autocast's bf16 casts, cached for the
micro-batch, and FSDP2's gathered units."""


@dataclass(frozen=True)
class CheckpointingChoice:
    on: bool
    update_without: int
    """Bytes of the actor update phase per GPU without checkpointing."""
    update_with: int
    limit: int
    """The most the update may take for checkpointing to stay off."""


def choose_checkpointing(model: str, a: ModelArchitecture, o: PlanOptions) -> CheckpointingChoice:
    """On when the update without checkpointing exceeds the limit; needs ``o.gpu_bytes``."""
    if o.gpu_bytes is None:
        raise ValueError("choose_checkpointing needs the GPU's memory (PlanOptions.gpu_bytes)")
    update = {
        on: mp.build_plan(model, a, dataclasses.replace(o, gradient_checkpointing=on)).phase_bytes(
            mp.UPDATE
        )
        for on in (False, True)
    }
    limit = int((1 - CHECKPOINTING_MARGIN) * usable_bytes(o.gpu_bytes))
    return CheckpointingChoice(update[False] > limit, update[False], update[True], limit)


def forward_bytes_per_token(a: ModelArchitecture, compute_bytes: int = 2) -> int:
    """Peak bytes per token of a no-grad forward: one layer's intermediates at a time (the
    same elements a layer keeps for a backward), the residual stream, and the final norm's
    input, output and the gathered response states."""
    layer = mp.largest_layer_activation_elements(a)
    return (layer + 4 * a.hidden_size) * compute_bytes


def forward_logits_bytes(a: ModelArchitecture, tokens: int, compute_bytes: int = 2) -> int:
    """One chunk of logits in the compute dtype, its fp32 copy and (for the entropy) fp32
    probabilities (models/heads/logprobs.py)."""
    return min(tokens, mp.LOGPROB_CHUNK_TOKENS) * a.vocab_size * (compute_bytes + 8)


def forward_bytes(a: ModelArchitecture, tokens: int, compute_bytes: int = 2) -> int:
    """A log-prob forward's working set at ``tokens`` tokens."""
    return tokens * forward_bytes_per_token(a, compute_bytes) + forward_logits_bytes(
        a, tokens, compute_bytes
    )


def forward_resident_bytes(plan: MemoryPlan) -> int:
    """What a training GPU holds while a log-prob pass runs: every item held in all phases
    (weights, AdamW state, reference and rollout copies, a kept KV cache) and the actor's
    weight copies (the gradients are freed after each optimizer step)."""
    held = [i for i in plan.items if not i.rollout_gpu and set(mp.PHASES) <= set(i.phases)]
    copies = [i for i in plan.items if i.name.startswith(WEIGHT_COPIES)]
    return sum(i.gpu_bytes for i in held + copies)


def forward_token_budget(plan: MemoryPlan, update_tokens: int, batch_tokens: int) -> int:
    """Tokens per GPU of a log-prob micro-batch (module docstring); needs the GPU's size.

    ``update_tokens``: the update's micro-batch budget; ``batch_tokens``: the most tokens one
    GPU holds of a step's batch (samples × the longest sequence)."""
    fitting = fitting_forward_tokens(plan) // BUDGET_STEP * BUDGET_STEP
    cap = min(FORWARD_BUDGET_CAP * update_tokens, max(batch_tokens, update_tokens))
    return max(min(fitting, cap), update_tokens)


def fitting_forward_tokens(plan: MemoryPlan) -> int:
    """The most tokens of a log-prob forward that fit beside what stays resident (0: none);
    needs the GPU's size."""
    o, a = plan.options, plan.architecture
    if o.gpu_bytes is None:
        raise ValueError("the forward's budget needs the GPU's memory (PlanOptions.gpu_bytes)")
    free = usable_bytes(o.gpu_bytes) - forward_resident_bytes(plan)
    logits = forward_logits_bytes(a, mp.LOGPROB_CHUNK_TOKENS, o.compute_bytes)
    return max(free - logits, 0) // forward_bytes_per_token(a, o.compute_bytes)


# ---------------------------------------------------------------------- update token budget

UPDATE_BUDGET_CAP = 65536
"""Most tokens of an ``actor.max_tokens_per_gpu=auto`` micro-batch: well before this the
matmuls run at full speed, and a larger micro-batch only holds more activations."""

NO_RECOMPUTE_MIN_BUDGET = 16384
"""With ``model.gradient_checkpointing=auto`` too, the budget shrinks down to this many tokens
to keep checkpointing off before turning it on: recomputing every layer costs ~30% more update
compute, while packed micro-batches of 16,384 tokens already run at ~50% MFU at 1.5b (the
training-throughput benchmark's budget, docs/performance.md)."""


UPDATE_BUDGET_MARGIN = 0.20
"""Share of the usable memory an ``auto`` budget's update leaves free: the budget lands its
update right at the limit every time, and the plan's update peaks were 6-12% under the
measured ones on an H200 (7b full-parameter and LoRA, docs/performance.md, Big models on one
GPU), so checkpointing's 10% would leave an OOM to chance."""


@dataclass(frozen=True)
class UpdateBudgetChoice:
    tokens: int
    checkpointing: bool
    fits: bool
    """False: not even one whole sequence's update fits (the plan's fit check says what to do)."""
    limit: int
    """The most the update phase may take (UPDATE_BUDGET_MARGIN under the usable memory)."""


def round_up(tokens: int, step: int = BUDGET_STEP) -> int:
    return -(-tokens // step) * step


def largest_fitting_tokens(update_bytes, low: int, high: int, limit: int) -> int | None:
    """The largest multiple of BUDGET_STEP in [low, high] with update_bytes(tokens) <= limit
    (update_bytes grows with tokens); None when even ``low`` does not fit."""
    if update_bytes(low) > limit:
        return None
    lo, hi = low // BUDGET_STEP, high // BUDGET_STEP  # lo fits; find the last that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if update_bytes(mid * BUDGET_STEP) <= limit else (lo, mid - 1)
    return lo * BUDGET_STEP


def choose_update_budget(
    update_bytes, gpu_bytes: int, checkpointing: bool | str, max_len: int, batch_tokens: int
) -> UpdateBudgetChoice:
    """actor.max_tokens_per_gpu=auto: the most tokens (a multiple of BUDGET_STEP, at least one
    whole sequence of ``max_len``, at most UPDATE_BUDGET_CAP and the mini-batch's
    ``batch_tokens`` on one GPU) whose update phase, ``update_bytes(tokens, checkpointing)``,
    stays UPDATE_BUDGET_MARGIN under the usable memory. ``checkpointing`` "auto": off when at least
    NO_RECOMPUTE_MIN_BUDGET tokens (or the whole range) fit so, else on."""
    low = round_up(max_len)
    high = max(low, min(UPDATE_BUDGET_CAP, round_up(batch_tokens)))
    limit = int((1 - UPDATE_BUDGET_MARGIN) * usable_bytes(gpu_bytes))

    def largest(on: bool) -> int | None:
        return largest_fitting_tokens(lambda t: update_bytes(t, on), low, high, limit)

    if checkpointing is not True:
        off = largest(False)
        if checkpointing is False or off is not None and off >= min(NO_RECOMPUTE_MIN_BUDGET, high):
            return UpdateBudgetChoice(off or low, False, off is not None, limit)
    on = largest(True)
    return UpdateBudgetChoice(on or low, True, on is not None, limit)
