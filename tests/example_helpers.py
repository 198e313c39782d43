"""The command an example's first line gives (examples/*.yaml), for the tests that run it."""

from __future__ import annotations

from pathlib import Path


def command_overrides(path: Path, local_files: dict[str, str] | None = None) -> list[str]:
    """The KEY=VALUE overrides of the ``hybridflow train --config`` command that the example's
    first line gives, each key of ``local_files`` pointed at the file given for it instead
    (a checkpoint a test cannot have, such as a reward model)."""
    first = path.read_text().splitlines()[0]
    train = first.split("hybridflow train ")[-1].split()
    assert train[:2] == ["--config", f"examples/{path.name}"], first
    local_files = local_files or {}
    overrides = []
    for word in train[2:]:
        key = word.split("=")[0]
        overrides.append(f"{key}={local_files[key]}" if key in local_files else word)
    return overrides
