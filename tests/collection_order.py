"""The order `make test` hands test files to its processes (tests/conftest.py applies it)."""

from __future__ import annotations

from collections import Counter


def slow_files_first(items: list) -> None:
    """Sort ``items`` (pytest's collected tests) in place: the files with the most
    slow-marked tests first, each file's tests in their order and in one piece.

    `make test` spreads whole files over its processes in collection order (pytest-xdist's
    ``--dist loadfile --no-loadscope-reorder``): starting the long files first leaves short
    ones for the end, so both processes finish together. xdist's own order (most tests
    first) put the files of one or two long runs last, and one process ran such a file
    alone, for up to a minute, while the other waited."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: a file's tests stay together
