"""YAML read with bounds on its shape, so a crafted file fails in one line instead of a
RecursionError or a process that expands aliases until memory runs out.

A config is a few levels deep and a few hundred values long. Two things YAML allows go far
beyond that with a few bytes: brackets nested thousands deep (the composer recurses once per
level), and aliases to aliases ("billion laughs": nine levels of nine ``*refs`` stand for 9⁹
values). The event stream is read first, without building anything: its depth and the
number of values it stands for, each alias counted as the size of what it names, are bounded
before ``yaml.safe_load`` builds the value.
"""

from __future__ import annotations

from typing import Any

from hybridflow.config.sections import ConfigError

MAX_DEPTH = 32
"""Nesting levels of mappings and lists (a config uses at most about five)."""
MAX_VALUES = 100_000
"""Values a document stands for with every alias expanded (scalars, lists and mappings)."""


def check_shape(text: str, source: str) -> None:
    """ConfigError naming ``source`` when ``text`` nests deeper than MAX_DEPTH or stands for
    more than MAX_VALUES values once its aliases are expanded. YAML syntax errors are left to
    the loader, which says where they are."""
    import yaml

    anchored: dict[str, int] = {}  # anchor -> values its node stands for
    open_nodes: list[list] = []  # [anchor, values inside] per mapping or list not yet closed
    expanded = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionEndEvent):
                anchor, inside = open_nodes.pop()
                if anchor:
                    anchored[anchor] = 1 + inside
                if open_nodes:
                    open_nodes[-1][1] += inside
                continue
            if isinstance(event, yaml.AliasEvent):
                if any(anchor == event.anchor for anchor, _ in open_nodes):
                    raise ConfigError(
                        [f"{source}: the alias *{event.anchor} is inside the value it names "
                         f"(a value that contains itself): write the value out"]
                    )  # fmt: skip
                size = anchored.get(event.anchor, 1)
            elif isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
                size = 1
                if isinstance(event, yaml.ScalarEvent) and event.anchor:
                    anchored[event.anchor] = 1
            else:
                continue  # stream and document markers
            expanded += size
            if open_nodes:
                open_nodes[-1][1] += size
            if isinstance(event, yaml.CollectionStartEvent):
                open_nodes.append([event.anchor, 0])
                if len(open_nodes) > MAX_DEPTH:
                    raise ConfigError(
                        [f"{source} nests lists or mappings more than {MAX_DEPTH} levels deep: "
                         f"a config needs a few; flatten it"]
                    )  # fmt: skip
            if expanded > MAX_VALUES:
                raise ConfigError(
                    [f"{source} stands for more than {MAX_VALUES:,} values once its YAML "
                     f"aliases (*name) are expanded: write the values out, or use fewer "
                     f"aliases of aliases"]
                )  # fmt: skip
    except yaml.YAMLError:
        return  # safe_load reports it, with the line


def load_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load(text)`` after :func:`check_shape`; YAMLError as safe_load raises it."""
    import yaml

    check_shape(text, source)
    return yaml.safe_load(text)
