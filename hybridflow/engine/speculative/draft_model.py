"""A small draft model (EngineOptions.speculative="draft"): it samples each tail row's next k
tokens from its own distribution q, which the verify pass accepts by speculative sampling
against the target's p (model_verify.py), so the emitted tokens keep the target's
distribution whatever the draft proposes.

The draft keeps a cache of its own for the rows it drafts for (DraftCache: a slot cache of
the engine's kinds, speculative_max_rows slots, made with the scheduler and freed with it). A
row's slot holds the K/V of a prefix of its tokens and of the drafts fed after them; each
call first catches up on the tokens the row emitted since (the accepted drafts already in
the slot are kept, the rest recomputed), then feeds its drafts one position at a time.
Rejected drafts are rolled back by length alone, as the target's are (verify.py): their K/V
lie past the prefix the next call keeps and are overwritten before anything reads them.

A per-sequence kind (a Gated DeltaNet layer's recurrent state, a sliding layer's ring: a
Qwen3.5 or GPT-OSS draft) moves through every draft fed and cannot be cut back by length.
So after the catch-up, before its drafts are fed, the drafting rows' per-sequence kinds are
copied (rollback.save: the state at the row's last emitted token, which the verify pass
keeps whatever it rejects), and the next call restores them (rollback.restore) and feeds
the tokens emitted since, the accepted drafts among them, again; the attention layers'
K/V at those positions are recomputed (the same values, up to rounding). A row whose copy
is gone (it drafted nothing at the last call) is fed again from its first token, its state
from zeros.
The copies are one call's drafting rows only: at most speculative_max_rows x the draft's
per-sequence bytes a row (Qwen3.5-0.8B in bf16: 18 Gated DeltaNet layers of a 6,144-channel
conv (3 inputs) and a 16 x 128 x 128 fp32 state, ~19.5 MB a row; GPT-OSS-20B: 12 rings of
128 positions, 8 x 64 K and V in bf16, ~3.1 MB a row), reserved beside the engine's cache
with the DraftCache (DraftModel.cache_bytes).

The draft's embedding table may be padded to another size than the target's (Qwen2.5-0.5B's
151,936 rows beside Qwen2.5-7B's 152,064, one tokenizer): its logits are cut or padded with
-inf to the target's vocabulary before q is formed, so q is over the target's ids and draws
only ids both tables have, and a token of the row past the draft's table is fed to it as id
0. Speculative sampling is exact for any q it drew from, so that changes how often drafts
are accepted, never the emitted tokens' distribution.

    draft = DraftModel.load("qwen2.5-0.5b", target_config, device, dtype)
    tokens, q = draft.propose(scheduler, limits)    # tokens per row, q [R, K, V]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hybridflow.engine.cache.kinds import engine_gaps
from hybridflow.engine.speculative import rollback
from hybridflow.engine.speculative.draws import DRAFT_SALT, draw, row_distributions, salted_keys

if TYPE_CHECKING:
    from hybridflow.engine.scheduling.state import SchedulerState


def draft_model_problem(config, name: str, prefix: str = "") -> str | None:
    """Why a draft model of this config cannot draft (one line naming the key, with `prefix`
    before the option names: "rollout.engine." at validate), or None. Recurrent states and
    windows' rings draft (DraftCache.resume rolls them back)."""
    key, ngram = f"{prefix}speculative_draft_model={name!r}", f"{prefix}speculative=ngram"
    gaps = engine_gaps(config.layer_specs())
    if gaps:
        return (f"{key}: the engine's passes cannot run it ({gaps[0]}); name a draft of "
                f"layers the engine runs, or set {ngram}")  # fmt: skip
    if getattr(config, "vision", None) is not None or getattr(config, "mrope_section", None):
        return (f"{key}: a vision-language model cannot draft (its positions follow the "
                f"images); name a text-only model of the same tokenizer, or set {ngram}")  # fmt: skip
    return None


def to_vocabulary(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """logits [N, V] cut or padded with -inf to [N, vocab]: a distribution formed from them
    is over the first `vocab` ids and never gives an id past V."""
    width = logits.shape[-1]
    if width >= vocab:
        return logits[:, :vocab]
    return torch.nn.functional.pad(logits, (0, vocab - width), value=float("-inf"))


@dataclass
class DraftRow:
    """A row's draft slot: K/V of the row's first `kept` tokens (prompt and response), then
    of the drafts `fed` after them (none kept in a cache with per-sequence kinds, whose
    state is restored to `kept`: DraftCache.resume)."""

    slot: int
    kept: int = 0
    fed: list[int] = field(default_factory=list)

    def reusable(self, context: list[int]) -> int:
        """Positions of the slot still valid for `context` (the row's tokens now, which
        extend the ones it held): the kept prefix and the fed drafts that were accepted,
        leaving at least the last token to feed (its logits draft the next)."""
        valid = self.kept
        for token in self.fed:
            if valid >= len(context) - 1 or context[valid] != token:
                break
            valid += 1
        return min(valid, len(context) - 1)


class DraftCache:
    """The draft's cache for the scheduler's rows (module docstring): made at the first draft
    and dropped with the scheduler (Engine.release). With per-sequence kinds, `saved` holds
    them for the rows of `saved_slots` as they were after the last call's catch-up."""

    def __init__(self, model, slots: int, max_seq_len: int):
        from hybridflow.engine.cache.sizing import make_cache
        from hybridflow.engine.rope_table import RopeTable

        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        self.cache, _ = make_cache(model.config, slots, max_seq_len, None, None, 0, dtype, device)
        self.rope = RopeTable(model.config, max_seq_len, dtype, device)
        self.free = list(range(self.cache.num_slots - 1, -1, -1))
        self.rows: dict[int, DraftRow] = {}  # LiveRequest.key -> its slot
        self.per_sequence = bool(rollback.sequence_tensors(self.cache))
        self.saved: list[torch.Tensor] | None = None
        self.saved_slots: list[int] = []

    def slots_for(self, keys: list[int]) -> list[DraftRow | None]:
        """Each key's row (a new one for a new key; None when no slot is free), the slots of
        keys no longer asked for given back first (bounded memory)."""
        wanted = set(keys)
        for key in [key for key in self.rows if key not in wanted]:
            self.free.append(self.rows.pop(key).slot)
        for key in keys:
            if key not in self.rows and self.free:
                self.rows[key] = DraftRow(self.free.pop())
        return [self.rows.get(key) for key in keys]

    def resume(self, entries: list[DraftRow], contexts: list[list[int]]) -> list[int]:
        """Each row's first position to feed, its slot made ready for it: K/V are valid up
        to there; per-sequence kinds are valid only at `kept` (restored from the copy saved
        then), so a row without its copy starts at 0 (its state from zeros)."""
        starts = [entry.reusable(context) for entry, context in zip(entries, contexts)]
        if not self.per_sequence:
            return starts
        line = {slot: i for i, slot in enumerate(self.saved_slots)}
        resumed = [r for r, (entry, start) in enumerate(zip(entries, starts))
                   if 0 < start == entry.kept and entry.slot in line]  # fmt: skip
        if resumed:
            rollback.restore(self.cache, self.saved_slots, self.saved,
                             [line[entries[r].slot] for r in resumed])  # fmt: skip
        chosen = set(resumed)
        return [start if r in chosen else 0 for r, start in enumerate(starts)]

    def checkpoint(self, entries: list[DraftRow]) -> None:
        """Copy these rows' per-sequence kinds (caught up, no draft fed yet), dropping the
        last call's copies: memory of one call's drafting rows."""
        if self.per_sequence:
            self.saved = None  # freed before the new copies are made
            self.saved_slots = [entry.slot for entry in entries]
            self.saved = rollback.save(self.cache, self.saved_slots)


class DraftModel:
    """The draft model of an engine (module docstring); its cache lives in the scheduler's
    DraftCache."""

    def __init__(self, model, target_config, name: str = "draft"):
        from hybridflow.models.llama import CausalLM

        if not isinstance(model, CausalLM):
            raise ValueError(f"speculative_draft_model={name!r}: not a model of hybridflow's "
                             "own decoder (the engine's passes run the draft)")  # fmt: skip
        problem = draft_model_problem(model.config, name)
        if problem is not None:
            raise ValueError(problem)
        self.model = model.eval().requires_grad_(False)
        self.table = model.config.vocab_size  # the ids the draft can read
        self.vocab = target_config.vocab_size  # the ids q is over (the target's)

    def cache_bytes(self, slots: int, max_seq_len: int) -> int:
        """The bytes of a DraftCache of `slots` slots and the copies of its per-sequence kinds
        for as many rows (the engine reserves them beside its own cache: allocation.py)."""
        from hybridflow.engine.cache.kinds import kv_layer_rows, recurrent_state_spec
        from hybridflow.engine.cache.latent import latent_spec
        from hybridflow.engine.cache.sizing import bytes_per_slot
        from hybridflow.engine.cache.window import window_spec

        config, dtype = self.model.config, next(self.model.parameters()).dtype
        layers = sum(row is not None for row in kv_layer_rows(config.layer_specs()))
        latent = latent_spec(config, dtype)
        per_position = latent.bytes_per_position if latent is not None else 0
        shape = (config.num_key_value_heads, config.head_dim)
        kinds = (recurrent_state_spec(config, dtype), window_spec(config, dtype, max_seq_len))
        per_sequence = sum(kind.bytes_per_sequence for kind in kinds if kind is not None)
        slot = bytes_per_slot(layers, *shape, max_seq_len, dtype, per_position) + per_sequence
        return (slots + 1) * slot + slots * per_sequence

    @classmethod
    def load(cls, name: str, target_config, device, dtype) -> DraftModel:
        """A preset (random weights: for benchmarks) or a local HF directory."""
        from hybridflow.models import load_model

        return cls(load_model(name, dtype=dtype, device=device, backend="native"), target_config,
                   name)  # fmt: skip

    @torch.no_grad()
    def propose(self, scheduler: SchedulerState, limits: list[int]
                ) -> tuple[list[list[int]], torch.Tensor | None]:  # fmt: skip
        """Up to limits[r] draft tokens for each of the scheduler's rows (their tokens read
        back), sampled from q with each row's sampling settings and seed. -> (the tokens,
        q [R, K, V] fp32 with K the longest draft, zeros past a row's draft; None if no
        row drafts)."""
        if scheduler.draft_cache is None:  # a slot for each row of a tail
            slots = min(scheduler.engine.options.speculative_max_rows, scheduler.cache.num_slots)
            scheduler.draft_cache = DraftCache(self.model, slots, scheduler.cache.max_seq_len)
        rows = scheduler.rows
        entries = scheduler.draft_cache.slots_for([live.key for live in rows])
        limits = [limit if entry is not None else 0 for limit, entry in zip(limits, entries)]
        width = max(limits, default=0)
        if width <= 0:
            return [[] for _ in rows], None
        contexts = [[*live.sub.prompt_of(live.request), *live.tokens] for live in rows]
        active = [r for r, limit in enumerate(limits) if limit > 0]
        logits = self._catch_up(scheduler.draft_cache, [entries[r] for r in active],
                                [contexts[r] for r in active])  # fmt: skip
        tokens, q = self._sample(scheduler, active, limits, contexts, entries, logits, width)
        drafts = [[] for _ in rows]
        per_sequence = scheduler.draft_cache.per_sequence  # resumes at `kept`, none fed kept
        for r, row_tokens in zip(active, tokens.tolist()):
            drafts[r] = row_tokens[: limits[r]]
            entries[r].kept = len(contexts[r])
            entries[r].fed = [] if per_sequence else drafts[r][:-1]
        return drafts, q

    def _catch_up(self, cache: DraftCache, entries: list[DraftRow], contexts: list[list[int]]):
        """Feed each row the tokens its slot lacks, then copy its per-sequence kinds (before
        any draft moves them); -> logits at each row's last token."""
        ids, positions, slots, last = [], [], [], []
        for entry, context, start in zip(entries, contexts, cache.resume(entries, contexts)):
            ids += context[start:]
            positions += range(start, len(context))
            slots += [entry.slot] * (len(context) - start)
            last.append(len(ids) - 1)
        logits = self._forward(cache, ids, positions, slots, last)
        cache.checkpoint(entries)
        return logits

    def _forward(self, cache: DraftCache, ids, positions, slots, last) -> torch.Tensor:
        from hybridflow.engine.prefill import extend_forward

        device = cache.cache.keys.device
        as_tensor = lambda values: torch.as_tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        ids = as_tensor(ids)
        ids = ids.masked_fill(ids >= self.table, 0)  # the target's ids past the draft's table
        logits = extend_forward(self.model, cache.cache, cache.rope, ids, as_tensor(positions),
                                as_tensor(slots), as_tensor(last))  # fmt: skip
        return to_vocabulary(logits, self.vocab)

    def _sample(self, scheduler, active, limits, contexts, entries, logits, width):
        """Draft tokens one position at a time: draw from q at each, feed it, until each
        row has its limit. -> (tokens [A, width] of the active rows, q [R, width, V])."""
        state = scheduler.state
        device = logits.device
        q = torch.zeros((len(limits), width, logits.shape[-1]), device=device)
        tokens = torch.zeros((len(active), width), dtype=torch.int64, device=device)
        column = {r: j for j, r in enumerate(active)}  # a row's line in `tokens`
        here = active  # the rows the logits are of
        for i in range(width):
            index = torch.as_tensor(here, device=device)
            probs, _ = row_distributions(logits, state.temperature[index], state.top_k[index],
                                         state.top_p[index], state.min_p[index])  # fmt: skip
            keys = salted_keys(state.seed_lo[index], state.seed_hi[index],
                               state.generated[index] + i, DRAFT_SALT)  # fmt: skip
            drawn = draw(probs, keys)
            q[index, i] = probs
            tokens[torch.as_tensor([column[r] for r in here], device=device), i] = drawn
            going = [j for j, r in enumerate(here) if limits[r] > i + 1]
            if not going:
                break
            here = [here[j] for j in going]
            ids = drawn[torch.as_tensor(going, device=device)]
            positions = [len(contexts[r]) + i for r in here]
            logits = self._forward(scheduler.draft_cache, ids, positions,
                                   [entries[r].slot for r in here], list(range(len(here))))  # fmt: skip
        return tokens, q
