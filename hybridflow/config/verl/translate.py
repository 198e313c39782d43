"""A verl command line -> our dotted overrides, with a row per translated key.

Each override is classified by its name: one of our keys stays ours; a key in the verl
mapping table (table.py, groups) is translated; a key under a verl-only section that the
table does not know is an error naming it. Hydra's ``+key=`` / ``++key=`` prefixes are
dropped and values are read as YAML, so ``['console','wandb']`` is a list and ``True`` a
bool. The translated overrides come first and ours after them, so a key of ours given on
the command line wins over what a verl key became.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.loading import MAX_KEY_CHARS, closest_key, shown
from hybridflow.config.sections import Config
from hybridflow.config.verl import converters, devices
from hybridflow.config.verl.group_table import GROUPS
from hybridflow.config.verl.rules import (
    Context,
    Entry,
    Group,
    GroupResult,
    Ignored,
    NotHere,
    Notice,
    Rename,
    Row,
    Unsupported,
    matches,
)
from hybridflow.config.verl.table import (
    SHARED_TABLE,
    TABLE,
    VERL_DEFAULTS,
    VERL_ONLY_SECTIONS,
)
from hybridflow.config.yaml_limits import load_yaml


@dataclass
class Translation:
    """Our overrides for a command line, and what became of each verl key."""

    overrides: list[str] = field(default_factory=list)
    """Translated overrides first, then ours as given (ours win)."""
    rows: list[Row] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    given: dict[str, str] = field(default_factory=dict)
    """verl key -> the value's text as given."""
    native: dict[str, str] = field(default_factory=dict)
    """Our key -> the value's text as given (the last one of each key)."""

    @property
    def has_verl_keys(self) -> bool:
        return bool(self.given)


def dump_value(value: Any) -> str:
    """A value as one line of YAML that reads back as the same value."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text[: -len("...")].strip() if text.endswith("\n...") else text


def parse_value(raw: str, source: str = "a value on the command line") -> Any:
    """``raw`` read as YAML, else the text itself (ConfigError beyond yaml_limits' bounds)."""
    import yaml

    try:
        return load_yaml(raw, source) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def our_keys() -> set[str]:
    """Every dotted key of ours: section.key and section.group.key."""
    cfg, keys = Config(), set()
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            keys.add(f"{section.name}.{f.name}")
            group = getattr(values, f.name)
            if dataclasses.is_dataclass(group):
                keys.update(f"{section.name}.{f.name}.{g.name}" for g in dataclasses.fields(group))
    return keys


def flatten(cfg: Config) -> dict[str, Any]:
    out = {}
    for section, values in dataclasses.asdict(cfg).items():
        for key, value in values.items():
            out[f"{section}.{key}"] = value
    return out


def _entry(key: str, table: Sequence[Entry]) -> Entry | None:
    return next((e for e in table if matches(e.verl, key)), None)


def _group(key: str) -> Group | None:
    return next((g for g in GROUPS if key in g.keys), None)


def _verl_subsections() -> set[str]:
    """``critic.model``, ``algorithm.kl_ctrl``, ...: verl's groups inside sections we share."""
    keys = [e.verl for e in TABLE] + [k for g in GROUPS for k in g.keys]
    return {".".join(k.split(".")[:2]) for k in keys if k.count(".") >= 2}


def is_verl_key(key: str, ours: set[str]) -> bool:
    """verl's by its name: not one of ours, and in the table, under a verl-only section, or
    under one of verl's groups inside a section we share (``critic.model.*``)."""
    if key in ours:
        return False
    return bool(
        _group(key)
        or _entry(key, TABLE)
        or key.split(".")[0] in VERL_ONLY_SECTIONS
        or (key.count(".") >= 2 and ".".join(key.split(".")[:2]) in _verl_subsections())
    )


def _split(item: str) -> tuple[str, str] | None:
    if "=" not in item:
        return None
    key, raw = item.split("=", 1)
    return key.strip().lstrip("+"), raw


def _apply_entry(entry: Entry, key: str, value: Any, raw: str, out: GroupResult) -> None:
    shown = f"{key}={raw}"
    if isinstance(entry, Ignored):
        out.notices.append(Notice(key, entry.why))
    elif isinstance(entry, Unsupported):
        if entry.harmless is not None and entry.harmless(value):
            out.notices.append(Notice(key, f"no effect: {entry.feature} is not in hybridflow"))
        else:
            out.lacks(entry.feature, shown)
    else:
        try:
            converted = entry.convert(value) if entry.convert else value
        except NotHere as missing:
            out.lacks(missing.feature, shown)
        except converters.KeepOurs as keep:
            out.notices.append(Notice(key, keep.why))
        else:
            out.rows.append(Row((key,), entry.ours, converted))


def _unknown(key: str, ours: set[str]) -> str:
    known = sorted(
        {e.verl.removesuffix(".*") for e in TABLE} | {k for g in GROUPS for k in g.keys} | ours
    )
    close = closest_key(key, known)
    hint = f"; did you mean {close!r}?" if close else ""
    return (
        f"unknown key {shown(key, quote=False)}: neither a hybridflow key nor a verl key "
        f"hybridflow knows{hint}"
    )


def _source(key: str) -> str:
    return f"the value of override {key}"


def _classify(overrides: Sequence[str], ours: set[str], given: dict[str, str]):
    """(verl key -> parsed value, our overrides as (key, raw text or None)); fills ``given``
    with the text of each verl value."""
    verl_values: dict[str, Any] = {}
    native: list[tuple[str, str | None]] = []
    for item in overrides:
        split = _split(item)
        if split is None or not is_verl_key(split[0], ours):
            native.append(split or (item, None))
            continue
        verl_values[split[0]] = parse_value(split[1], _source(split[0]))
        given[split[0]] = split[1]
    if given:  # a verl command line: shared keys read with verl's meaning are translated
        for key, raw in list(native):
            if raw is not None and (_entry(key, SHARED_TABLE) or _group(key)):
                native.remove((key, raw))
                verl_values[key], given[key] = parse_value(raw, _source(key)), raw
    return verl_values, native


def translate(
    overrides: Sequence[str], base: Config | None = None, set_by_file: Set[str] = frozenset()
) -> Translation:
    """Our overrides for ``overrides`` (verl's keys and ours mixed); ``base``: the config the
    overrides apply to (the YAML file's), read for context such as the device count;
    ``set_by_file``: the dotted keys the YAML file sets, which verl's defaults leave alone
    even where the file's value is our default."""
    ours = our_keys()
    out, result = Translation(), GroupResult()
    too_long = [item for item in overrides if len(item.split("=", 1)[0]) > MAX_KEY_CHARS]
    if too_long:  # read no further: matching a 10 MB key against the tables takes minutes
        out.problems = [
            f"override key {shown(item.split('=', 1)[0])} is longer than any config key: "
            f"give section.key=value (e.g. rollout.n=8)"
            for item in too_long
        ]
        return out
    verl_values, native_items = _classify(overrides, ours, out.given)
    ours_given = {k: parse_value(raw, _source(k)) for k, raw in native_items if raw is not None}
    base_values = flatten(base or Config())
    defaults = (
        _verl_defaults(verl_values, ours_given, base_values, set_by_file) if out.given else []
    )
    ours_seen = {**base_values, **{row.ours: row.value for row in defaults}, **ours_given}
    ctx = Context(verl=verl_values, ours=ours_seen)
    grouped: dict[str, dict[str, Any]] = {}
    for key, value in verl_values.items():
        group = _group(key)
        if group is not None:
            grouped.setdefault(group.name, {})[key] = value
            continue
        entry = _entry(key, SHARED_TABLE) or _entry(key, TABLE)
        if entry is None:
            result.problems.append(_unknown(key, ours))
        else:
            _safely(key, result, _apply_entry, entry, key, value, out.given[key], result)
    for group in GROUPS:
        given = grouped.get(group.name, {})
        if given or any(k in verl_values for k in group.also_when):
            what = ", ".join(given) or group.name
            _safely(what, result, _run_group, group, given, ctx, result)
    backend = devices.backend(ctx, ours_given) if out.given else None
    if backend is not None:
        result.rows.append(backend)
    if out.given:
        translated = {row.ours for row in result.rows}
        result.rows[:0] = [row for row in defaults if row.ours not in translated]
    _finish(out, result, native_items)
    return out


def _verl_defaults(
    verl_values: Mapping, ours_given: Mapping, base: Mapping, set_by_file: Set[str]
) -> list[Row]:
    """verl's default for each key of VERL_DEFAULTS the command line leaves out, where our
    key is neither given on the command line nor set by the YAML file (to any value, our
    default included: ``algorithm.adv_estimator: grpo`` in the file stays GRPO)."""
    ours_default = flatten(Config())
    out = []
    for verl_key, ours, value in VERL_DEFAULTS:
        if verl_key in verl_values or ours in ours_given or ours in set_by_file:
            continue
        if base[ours] != ours_default[ours]:  # a base config built in code, not from a file
            continue
        yields_to = ("trainer.total_steps",) if ours == "trainer.total_epochs" else ()
        out.append(Row((), ours, value, yields_to, default_of=verl_key))
    return out


def _run_group(group: Group, given: Mapping, ctx: Context, result: GroupResult) -> None:
    _merge(result, group.rule(given, ctx))


def _safely(what: str, result: GroupResult, step, *args) -> None:
    try:
        step(*args)
    except (ValueError, TypeError) as error:  # e.g. int("abc") from a malformed value
        result.problems.append(f"{what}: cannot translate the value given ({error})")


def _merge(into: GroupResult, part: GroupResult) -> None:
    into.rows += part.rows
    into.notices += part.notices
    into.problems += part.problems
    for feature, items in part.missing.items():
        into.missing.setdefault(feature, []).extend(items)


def _finish(out: Translation, result: GroupResult, native: list[tuple[str, str | None]]) -> None:
    given_ours = {key for key, raw in native if raw is not None}
    for row in result.rows:
        replaced_by = [k for k in row.yields_to if k in given_ours]
        if replaced_by:
            why = f"replaced by {replaced_by[0]} given on the command line"
            out.notices += [Notice(k, why) for k in row.verl]
        else:
            out.rows.append(row)
    out.notices += result.notices
    out.problems += [_lacking(feature, items) for feature, items in result.missing.items()]
    out.problems += result.problems
    out.overrides = [f"{row.ours}={dump_value(row.value)}" for row in out.rows]
    for key, raw in native:
        out.overrides.append(key if raw is None else f"{key}={raw}")
        if raw is not None:
            out.native[key] = raw


def _lacking(feature: str, items: list[str]) -> str:
    if len(items) == 1:
        return f"{items[0]} asks for {feature}, which hybridflow does not have: remove it"
    return (
        f"{feature} is not in hybridflow: remove the {len(items)} keys that ask for it "
        f"({', '.join(items)})"
    )


def format_translation(t: Translation) -> str:
    """What the run prints once: each verl key, our key and the value; then the notices."""
    lines = ["verl keys translated (verl key=value  ->  hybridflow key = value):"]
    for row in t.rows:
        shown = {**t.native, **t.given}
        verl = ", ".join(f"{k}={shown[k]}" for k in row.verl if k in shown)
        verl = verl or f"(verl's default for {row.default_of})"
        lines.append(f"  {verl}  ->  {row.ours} = {dump_value(row.value)}")
    if t.notices:
        lines.append("verl keys accepted without effect:")
        lines += [f"  {n.verl}={t.given.get(n.verl, '')}: {n.why}" for n in t.notices]
    return "\n".join(lines)


def known_verl_keys() -> Mapping[str, str]:
    """Every verl key (or prefix) of the table and the groups -> what becomes of it."""
    out: dict[str, str] = {}
    for entry in [*TABLE, *SHARED_TABLE]:
        out.setdefault(entry.verl, _describe(entry))
    for group in GROUPS:
        out.update(group.keys)
    return out


def _describe(entry: Entry) -> str:
    if isinstance(entry, Rename):
        return entry.ours + (f" ({entry.how})" if entry.how else "")
    if isinstance(entry, Ignored):
        return f"ignored: {entry.why}"
    if entry.harmless_doc:
        return f"stops: {entry.feature} (accepted at {entry.harmless_doc})"
    return f"stops: {entry.feature}"


__all__ = ["GROUPS", "Translation", "format_translation", "translate"]
