"""``hybridflow config from-verl``: a translation written as our YAML config file, each line
commented with the verl key (and value) it came from, so a run can move over for good."""

from __future__ import annotations

from hybridflow.config.sections import SECTIONS
from hybridflow.config.verl.translate import Translation, dump_value, parse_value

HEADER = """\
# hybridflow train --config THIS_FILE
# Translated from a verl command line by `hybridflow config from-verl`; each key names the
# verl key it came from. Check it with: hybridflow config validate --config THIS_FILE"""


def _entries(t: Translation) -> dict[str, tuple[str, str]]:
    """Our dotted key -> (value as YAML, comment); later entries win, as on the command line."""
    out: dict[str, tuple[str, str]] = {}
    for row in t.rows:
        sources = ", ".join(f"{k}={t.given.get(k, t.native.get(k, ''))}" for k in row.verl)
        comment = f"verl: {sources}" if sources else f"verl's default for {row.default_of}"
        out[row.ours] = (dump_value(row.value), comment)
    for key, raw in t.native.items():
        out[key] = (dump_value(parse_value(raw)), "same key and meaning in verl")
    return out


def _nest(entries: dict[str, tuple[str, str]]) -> dict:
    order = list(SECTIONS)
    tree: dict = {}
    for key in sorted(entries, key=lambda k: order.index(k.split(".")[0])):
        leaf = entries[key]
        *parents, name = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = leaf
    return tree


def _lines(tree: dict, indent: int = 0) -> list[str]:
    lines = []
    for name, node in tree.items():
        pad = "  " * indent
        if isinstance(node, dict):
            lines.append(f"{pad}{name}:")
            lines += _lines(node, indent + 1)
        else:
            value, comment = node
            lines.append(f"{pad}{name}: {value}  # {comment}")
    return lines


def to_yaml(t: Translation) -> str:
    """The config file equivalent to the command line ``t`` was translated from."""
    lines = [HEADER, *_lines(_nest(_entries(t)))]
    if t.notices:
        lines.append("# verl keys accepted without effect:")
        lines += [f"#   {n.verl}={t.given.get(n.verl, '')}: {n.why}" for n in t.notices]
    return "\n".join(lines) + "\n"
