"""The kinds of entries in the verl mapping table, and the rows a translation produces.

An entry names one verl key (or a prefix ``a.b.*``) and says what becomes of it:

- :class:`Rename`: the value moves to one of our keys (``convert`` may change it);
- :class:`Ignored`: the key has no meaning here; accepted with a one-line reason;
- :class:`Unsupported`: a feature hybridflow does not have; the run stops naming it,
  unless ``harmless`` says the value leaves the feature off (then: a notice);
- :class:`Group`: several verl keys read together (batch-size normalisation, a path and a
  function name, ...) by one function with verl's defaults for the keys not given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class NotHere(Exception):
    """Raised by a converter: the value asks for ``feature``, which hybridflow lacks."""

    def __init__(self, feature: str):
        super().__init__(feature)
        self.feature = feature


@dataclass(frozen=True)
class Rename:
    verl: str
    ours: str
    convert: Callable[[Any], Any] | None = None
    how: str = ""
    """For the docs: how the value changes on the way (empty: unchanged)."""


@dataclass(frozen=True)
class Ignored:
    verl: str
    why: str


@dataclass(frozen=True)
class Unsupported:
    verl: str
    feature: str
    harmless: Callable[[Any], bool] | None = None
    """True for a value that leaves the feature off: then accepted with a notice."""
    harmless_doc: str = ""
    """For the docs: the harmless values, e.g. ``1``."""


@dataclass(frozen=True)
class Row:
    """One line of the translation: verl keys (with the values given) -> our key = value."""

    verl: tuple[str, ...]
    ours: str
    value: Any
    yields_to: tuple[str, ...] = ()
    """Our keys that, given on the command line, replace this row (e.g. trainer.total_steps
    replaces the trainer.total_epochs that verl's trainer.total_epochs became)."""
    default_of: str = ""
    """Set when the row is verl's default for this verl key (not given on the command line)."""


@dataclass(frozen=True)
class Notice:
    """A verl key accepted without effect, and why."""

    verl: str
    why: str


@dataclass
class GroupResult:
    rows: list[Row] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    missing: dict[str, list[str]] = field(default_factory=dict)
    """A feature hybridflow lacks -> the ``key=value`` items that ask for it."""

    def lacks(self, feature: str, item: str) -> None:
        self.missing.setdefault(feature, []).append(item)


@dataclass(frozen=True)
class Context:
    """What a group rule may read besides its own keys: every verl key given (name ->
    value, ``+`` stripped) and our keys given or loaded from the YAML file (dotted name ->
    value)."""

    verl: Mapping[str, Any]
    ours: Mapping[str, Any]

    def count(self, key: str) -> int:
        """One of our positive counts; 1 when unset or malformed (the loader reports that)."""
        value = self.ours.get(key, 1)
        return value if isinstance(value, int) and value >= 1 else 1

    def world_size(self) -> int:
        return self.count("trainer.nnodes") * self.count("trainer.n_gpus_per_node")


@dataclass(frozen=True)
class Group:
    name: str
    keys: Mapping[str, str]
    """verl key -> for the docs, what it becomes."""
    rule: Callable[[Mapping[str, Any], Context], GroupResult]
    """(the group's keys that were given -> value, context) -> rows, notices, problems."""
    also_when: tuple[str, ...] = ()
    """Other verl keys whose presence makes this group run (values inherited in verl)."""


Entry = Rename | Ignored | Unsupported


def matches(pattern: str, key: str) -> bool:
    """``a.b.*`` matches ``a.b.c`` and ``a.b.c.d``; other patterns match exactly."""
    if pattern.endswith(".*"):
        return key.startswith(pattern[:-1])
    return key == pattern
