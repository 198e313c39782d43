"""Checks of the speculative-decoding fields of EngineOptions (options.py): kept here so the
engine's option list stays one line per check. No torch import (the config reads it)."""

from __future__ import annotations

SPECULATIVE_METHODS = ("off", "ngram", "draft")
SPECULATIVE_RULES = ("measured", "always")
MAX_NGRAM = 16


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def speculative_problems(options) -> list[str]:
    """Problems with an EngineOptions' speculative_* fields, as 'field=value: what to change'
    lines (empty when valid)."""
    problems = []
    if options.speculative not in SPECULATIVE_METHODS:
        problems.append(f"speculative={options.speculative!r}: must be one of "
                        f"{', '.join(SPECULATIVE_METHODS)}")  # fmt: skip
    drafts, per_sync = options.speculative_draft_tokens, options.steps_per_sync
    if not _is_int(drafts) or drafts < 1:
        problems.append(f"speculative_draft_tokens={drafts!r}: must be an integer >= 1")
    elif options.speculative != "off" and _is_int(per_sync) and drafts > per_sync:
        # a verify pass emits up to drafts + 1 tokens; the read-back copies steps_per_sync + 1
        problems.append(f"speculative_draft_tokens={drafts}: at most steps_per_sync="
                        f"{per_sync} (raise steps_per_sync or draft fewer tokens)")  # fmt: skip
    rows = options.speculative_max_rows
    if not _is_int(rows) or rows < 1:
        problems.append(f"speculative_max_rows={rows!r}: must be an integer >= 1")
    low, high = options.speculative_min_ngram, options.speculative_max_ngram
    if not _is_int(low) or not _is_int(high) or not 1 <= low <= high <= MAX_NGRAM:
        problems.append(f"speculative_min_ngram={low!r}, speculative_max_ngram={high!r}: "
                        f"integers with 1 <= min <= max <= {MAX_NGRAM}")  # fmt: skip
    store = options.speculative_store_tokens
    if not _is_int(store) or store < 0:
        problems.append(f"speculative_store_tokens={store!r}: must be an integer >= 0 "
                        "(0: no earlier rollouts kept)")  # fmt: skip
    graphs = options.graph_verify_steps
    if not isinstance(graphs, bool):
        problems.append(f"graph_verify_steps={graphs!r}: must be true or false")
    elif graphs and options.speculative == "off":
        problems.append("graph_verify_steps=true captures verify passes: set speculative to "
                        "ngram or draft too")  # fmt: skip
    return problems + _draft_model_problems(options) + _rule_problems(options)


def _draft_model_problems(options) -> list[str]:
    draft = options.speculative_draft_model
    if options.speculative == "draft" and not (isinstance(draft, str) and draft):
        return ["speculative='draft' needs speculative_draft_model: a preset name or a local "
                "HF directory of a small model sharing the target's tokenizer"]  # fmt: skip
    if draft is not None and not isinstance(draft, str):
        return [f"speculative_draft_model={draft!r}: a preset name or a directory, or null"]
    return []


def _rule_problems(options) -> list[str]:
    problems = []
    if options.speculative_rule not in SPECULATIVE_RULES:
        problems.append(f"speculative_rule={options.speculative_rule!r}: must be one of "
                        f"{', '.join(SPECULATIVE_RULES)}")  # fmt: skip
    margin = options.speculative_margin
    number = isinstance(margin, (int, float)) and not isinstance(margin, bool)
    if not number or not 0 <= margin < float("inf"):
        problems.append(f"speculative_margin={margin!r}: must be a number >= 0 (0.1: verify "
                        "while passes emit 10% more than their seconds' worth of decode steps)")  # fmt: skip
    probe = options.speculative_probe_steps
    if not _is_int(probe) or probe < 1:
        problems.append(f"speculative_probe_steps={probe!r}: must be an integer >= 1")
    return problems
