"""Checks of rollout.engine.speculative that ``validate()`` runs before any model loads: a
draft model (speculative=draft) must exist, and be one the engine's passes run (no
vision-language model; recurrent states and windows' rings draft). Its embedding table may
be padded to another size than the model's (the engine cuts or pads its logits:
engine/speculative/draft_model.py); when both directories hold a tokenizer whose
vocabularies differ, a one-line warning says that its drafts will rarely be accepted. Reads
presets, config.json and tokenizer files only (no weights)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hybridflow.config.model_facts import trained_model
from hybridflow.config.sections import Config

log = logging.getLogger("hybridflow.config")

TOKENIZER_READ_BYTES = 64 << 20
"""The largest tokenizer file read for the vocabulary comparison (Qwen2.5's tokenizer.json
is 7 MB); a larger one is not compared (memory bounded whatever the directory holds)."""


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


def tokenizer_vocabulary(directory: str) -> dict[str, int] | None:
    """token -> id of the tokenizer in ``directory`` (tokenizer.json's model vocabulary and
    added tokens, else vocab.json); None when neither is there, readable and at most
    TOKENIZER_READ_BYTES."""
    path = Path(directory).expanduser()
    for name in ("tokenizer.json", "vocab.json"):
        file = path / name
        try:
            if not file.is_file() or file.stat().st_size > TOKENIZER_READ_BYTES:
                continue
            data = json.loads(file.read_text(encoding="utf-8"))
            return _vocabulary(data) if name == "tokenizer.json" else _token_ids(data)
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError, OSError):
            continue  # unreadable: no comparison (the model checks report a broken tokenizer)
    return None


def _vocabulary(tokenizer: dict) -> dict[str, int] | None:
    """tokenizer.json's token -> id: its model's vocabulary (a dict for BPE and WordPiece,
    a list of [piece, score] for Unigram) and its added tokens."""
    vocab = tokenizer["model"]["vocab"]
    if isinstance(vocab, list):
        vocab = {entry[0]: index for index, entry in enumerate(vocab)}
    tokens = _token_ids(vocab)
    if tokens is None:
        return None
    for added in tokenizer.get("added_tokens") or []:
        tokens[str(added["content"])] = int(added["id"])
    return tokens


def _token_ids(vocab) -> dict[str, int] | None:
    if not isinstance(vocab, dict):
        return None
    return {str(token): int(index) for token, index in vocab.items()}


def _tokenizer_warning(cfg: Config, draft_key: str, draft: str) -> None:
    """One line when the draft's directory and the model's (its tokenizer_path, else its
    directory) both hold a readable tokenizer and their vocabularies differ."""
    model = cfg.model.tokenizer_path or trained_model(cfg)
    if _hf_config(draft) is None or not Path(model).expanduser().is_dir():
        return  # a preset (the char tokenizer) or no directory: nothing to compare
    drafted, target = tokenizer_vocabulary(draft), tokenizer_vocabulary(model)
    if drafted is not None and target is not None and drafted != target:
        log.warning("%s = %r: its tokenizer's vocabulary differs from the model's (%s): "
                    "decoding stays exact but its drafts are rarely accepted, so the measured "
                    "rule turns speculation off; use a draft of the model's family",
                    draft_key, draft, model)  # fmt: skip


def speculative_problems(cfg: Config) -> list[str]:
    """Problems with the run's speculative decoding, one line each (empty when fine); warns
    of a draft whose tokenizer differs from the model's."""
    engine = cfg.rollout.engine
    draft = engine.speculative_draft_model
    if engine.speculative != "draft" or not isinstance(draft, str) or not draft:
        return []  # a missing draft model is the engine options' check
    draft_key = "rollout.engine.speculative_draft_model"
    if _preset(draft) is None and _hf_config(draft) is None:
        return [f"{draft_key} = {draft!r}: neither a preset nor a directory holding "
                "config.json"]  # fmt: skip
    problem = _unrunnable(draft)
    if problem is not None:
        return [problem]
    _tokenizer_warning(cfg, draft_key, draft)
    return []


def _unrunnable(draft: str) -> str | None:
    """The engine's refusal of this draft (engine/speculative/draft_model.py: layers its passes
    do not run, a vision-language model), read off its preset or config.json; None when it
    drafts or its config.json is left to the model checks."""
    from hybridflow.engine.speculative.draft_model import draft_model_problem
    from hybridflow.models.architecture import ModelArchitecture

    architecture = _preset(draft)
    if architecture is None:
        try:
            hf = json.loads((Path(draft).expanduser() / "config.json").read_text())
            architecture = ModelArchitecture.from_hf(hf)
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError, OSError):
            return None  # what is wrong with it is the model checks' to say
    return draft_model_problem(architecture, draft, prefix="rollout.engine.")
