"""Loading: defaults < YAML file < dotted overrides, with type checks and "did you mean".

Values of overrides are parsed as YAML scalars/lists, so ``data.train_files=[a,b]`` and
``actor.lr=1e-6`` both work.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hybridflow.config.sections import SECTIONS, Config, ConfigError
from hybridflow.config.yaml_limits import load_yaml


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Defaults < YAML file < dotted overrides. Raises ConfigError naming the bad keys."""
    cfg = Config()
    problems: list[str] = []
    if path is not None:
        problems += apply_mapping(cfg, read_yaml(path), source=str(path))
    for item in overrides:
        if "=" not in item:
            problems.append(
                f"override {shown(item)} is not of the form section.key=value (e.g. rollout.n=8)"
            )
            continue
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) not in (2, 3):
            problems.append(
                f"override key {shown(key)} must be section.key (e.g. actor.lr=1e-6) or "
                "section.group.key (e.g. rollout.engine.decode_layer=split)"
            )
            continue
        try:
            value: Any = _parse_scalar(raw, source=f"the value of override {key.strip()}")
        except ConfigError as error:
            problems += error.problems
            continue
        for name in reversed(parts[1:]):
            value = {name: value}
        problems += apply_mapping(cfg, {parts[0]: value}, source="command line")
    if problems:
        raise ConfigError(problems)
    return cfg


def keys_set_in(data: dict) -> set[str]:
    """The dotted keys a config mapping sets: ``section.key`` and ``section.group.key`` (a
    group given as a mapping sets the group's key and each of its own)."""
    out: set[str] = set()
    for section, values in data.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            out.add(f"{section}.{key}")
            if isinstance(value, dict):
                out.update(f"{section}.{key}.{inner}" for inner in value)
    return out


def read_yaml(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r} does not exist"])
    try:
        data = load_yaml(p.read_text(), source=f"config file {str(p)!r}") or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"config file {str(p)!r} is not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(
            [f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}"]
        )
    return data


def _parse_scalar(raw: str, source: str) -> Any:
    """An override's value read as YAML (``[a, b]``, ``1e-6``, ``true``); the text itself
    when it is not YAML. ConfigError naming ``source`` for a value nested or aliased beyond
    the limits of yaml_limits.py."""
    import yaml

    try:
        return load_yaml(raw, source) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(known))}"


MAX_KEY_CHARS = 200
"""Longer than any config key (verl's longest is under 80): no suggestion is looked for."""


def shown(value: Any, limit: int = 80, quote: bool = True) -> str:
    """``value`` as a message shows it: its repr (or text), cut to ``limit`` characters with
    the full length said, so a 10 MB value makes a one-line message."""
    text = repr(value) if quote else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def closest_key(key: str, known: Iterable[str]) -> str | None:
    """The dotted key of ``known`` that ``key`` most likely misspells, or None when none is
    close. Close means the whole key reads alike (ratio >= 0.8) *and* its last part does
    (>= 0.6): comparing whole keys alone would pair ``actor_rollout_ref.actor.xyz`` with
    ``actor_rollout_ref.actor.strategy`` on the strength of their shared prefix."""
    if len(key) > MAX_KEY_CHARS:
        return None
    leaf = key.rsplit(".", 1)[-1]
    best, best_ratio = None, 0.0
    for candidate in known:
        whole = difflib.SequenceMatcher(None, key, candidate).ratio()
        last = difflib.SequenceMatcher(None, leaf, candidate.rsplit(".", 1)[-1]).ratio()
        if whole >= 0.8 and last >= 0.6 and whole > best_ratio:
            best, best_ratio = candidate, whole
    return best


def _suggest_key(prefix: str, name: str, known: Iterable[str]) -> str:
    """``; did you mean 'rollout.n'?`` (the full dotted key), else the known names."""
    close = closest_key(f"{prefix}.{name}", [f"{prefix}.{k}" for k in known])
    return f"; did you mean {close!r}?" if close else f"; known: {', '.join(sorted(known))}"


MAX_WHOLE_NUMBER = 2**63 - 1
"""A whole-number setting reaches torch and numpy as int64: a larger one was an
OverflowError traceback there (rollout.top_k, trainer.seed, steps_per_sync)."""


def apply_mapping(cfg: Config, data: dict, source: str) -> list[str]:
    problems = []
    for section, values in data.items():
        if section not in SECTIONS:
            problems.append(
                f"unknown section {shown(section)} ({source}){_suggest(str(section)[:100], list(SECTIONS))}"
            )
            continue
        if not isinstance(values, dict):
            problems.append(
                f"section {section!r} ({source}) must be a mapping, got {shown(values)}"
            )
            continue
        problems += _apply_section(getattr(cfg, section), section, values, source)
    return problems


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A config section's annotations, resolved once per class (typing.get_type_hints
    evaluates every string annotation each time: most of a candidate layout's cost in the
    recommendation's thousands of candidate configs)."""
    return typing.get_type_hints(cls)


def _apply_section(sec: Any, prefix: str, values: dict, source: str) -> list[str]:
    """Set `values` on the dataclass `sec` (fields that are dataclasses themselves, like
    rollout.engine, take a mapping and are replaced, so frozen ones work too)."""
    problems = []
    hints = field_types(type(sec))
    for key, value in values.items():
        name = f"{prefix}.{key}"
        if key not in hints:
            problems.append(
                f"unknown key {shown(name, quote=False)} ({source}){_suggest_key(prefix, str(key), hints)}"
            )
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(
                    f"{name} ({source}) must be a mapping of its keys, got {shown(value)}"
                )
                continue
            group = dataclasses.replace(getattr(sec, key))  # a copy: the default is shared
            problems += _apply_section(group, name, value, source)
            _set(sec, key, group)
            continue
        ok, coerced = _coerce(value, tp)
        if not ok:
            problems.append(
                f"{name} ({source}) expects {_type_name(tp)}, got {shown(value)} "
                f"({type(value).__name__})"
            )
            continue
        if isinstance(coerced, float) and math.isnan(coerced):  # compares false to any bound
            problems.append(f"{name} ({source}) = nan: give a number")
            continue
        if isinstance(coerced, int) and abs(coerced) > MAX_WHOLE_NUMBER:
            problems.append(f"{name} ({source}) = {shown(coerced, quote=False)} is past the "
                            f"largest whole number a setting takes ({MAX_WHOLE_NUMBER:,})")  # fmt: skip
            continue
        _set(sec, key, coerced)
    return problems


def _set(sec: Any, key: str, value: Any) -> None:
    if type(sec).__dataclass_params__.frozen:
        object.__setattr__(sec, key, value)  # on a private copy (_apply_section's caller)
    else:
        setattr(sec, key, value)


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check ``value`` against annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return True, None
                continue
            ok, v = _coerce(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is Any:
        return True, value
    if origin is list:
        if isinstance(value, str):  # a single path given where a list is expected
            value = [value]
        if not isinstance(value, (list, tuple)):
            return False, value
        (item_tp,) = typing.get_args(tp) or (Any,)
        out = []
        for v in value:
            ok, c = _coerce(v, item_tp)
            if not ok:
                return False, value
            out.append(c)
        return True, out
    if origin is dict:
        return isinstance(value, dict), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                pass
        return False, value
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, str(value)  # e.g. model.path=7b parsed as a number-like string
        if isinstance(value, bool):  # YAML 1.1 reads off/no/false (on/yes/true) as booleans:
            return True, "on" if value else "off"  # actor.router_replay=off means "off"
        return isinstance(value, str), value
    return isinstance(value, tp), value


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def field_docs(section_cls: type) -> dict[str, str]:
    """Docstrings written under each dataclass field (read from the source)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(section_cls)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())  # type: ignore[attr-defined]
    return docs
