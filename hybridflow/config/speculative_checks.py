"""Checks of rollout.engine.speculative that ``validate()`` runs before any model loads: a
draft model (speculative=draft) must exist and share the model's vocabulary. Reads presets
and config.json only (no weights)."""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.config.model_facts import trained_model
from hybridflow.config.sections import Config


def _hf_config(path: str) -> dict | None:
    """The text model's config.json at ``path`` (a directory), None if absent or unreadable."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        return None
    try:
        hf = json.loads(file.read_text())
        return hf.get("text_config") or hf
    except (ValueError, TypeError, AttributeError, RecursionError, OSError):
        return None  # an unreadable config.json is reported by the model checks


def _preset(path: str):
    from hybridflow.models.presets import PRESETS

    return PRESETS.get(path)


def model_vocab_size(path: str) -> int | None:
    """The vocabulary size of the model at ``path`` (a preset or a directory); None if
    unknown."""
    hf = _hf_config(path)
    if hf is not None:
        try:
            return int(hf.get("vocab_size"))
        except (TypeError, ValueError):
            return None
    preset = _preset(path)
    return None if preset is None else int(preset.vocab_size)


def speculative_problems(cfg: Config) -> list[str]:
    """Problems with the run's speculative decoding, one line each (empty when fine)."""
    engine = cfg.rollout.engine
    model = trained_model(cfg)
    draft = engine.speculative_draft_model
    if engine.speculative != "draft" or not isinstance(draft, str) or not draft:
        return []  # a missing draft model is the engine options' check
    draft_key = "rollout.engine.speculative_draft_model"
    if _preset(draft) is None and _hf_config(draft) is None:
        return [f"{draft_key} = {draft!r}: neither a preset nor a directory holding "
                "config.json"]  # fmt: skip
    drafted, target = model_vocab_size(draft), model_vocab_size(model)
    if drafted is not None and target is not None and drafted != target:
        return [f"{draft_key} = {draft!r}: its vocabulary has {drafted} tokens, the model "
                f"{model!r} {target}: a draft model must share the tokenizer and vocabulary"]  # fmt: skip
    return []
