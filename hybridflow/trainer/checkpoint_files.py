"""The files of a checkpoint directory: regular files only, listed with their sizes.

A checkpoint is read by programs that trust what it points to (the loader, ``hybridflow
export``'s copy of the tokenizer), so a link inside it — to ``/etc/shadow``, to a folder of
5 GB — is refused, never followed, and named. ``damage`` says what is wrong with a complete
checkpoint's files compared with what ``metadata.json`` listed when it was saved.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

METADATA_FILE = "metadata.json"


def irregular_entries(directory: str | Path) -> list[str]:
    """Links (to files or folders, followed nowhere) and anything else that is not a regular
    file or folder under ``directory``, as ``relative name (what it is)``."""
    directory = Path(directory)
    found = []
    for parent, folders, files in os.walk(directory):  # does not follow links to folders
        for name in sorted(folders + files):
            path = Path(parent) / name
            relative = path.relative_to(directory)
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                found.append(f"{relative} (a link to {os.readlink(path)})")
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                found.append(f"{relative} (not a regular file)")
    return found


def links_problem(directory: str | Path) -> str | None:
    """One sentence naming the links (and special files) under ``directory``, or None."""
    entries = irregular_entries(directory)
    if not entries:
        return None
    return f"{directory} holds links, which are never followed: {', '.join(entries)}"


LINKS_FIX = (
    "replace each link by a copy of what it points to (cp -L), or remove it; hybridflow "
    "itself writes regular files only"
)


def file_sizes(directory: Path) -> dict[str, int]:
    """``{relative path: bytes}`` of every regular file under ``directory`` (links left out)."""
    sizes = {}
    for parent, _, files in os.walk(directory):
        for name in files:
            path = Path(parent) / name
            info = path.lstat()
            if stat.S_ISREG(info.st_mode):
                sizes[str(path.relative_to(directory))] = info.st_size
    return dict(sorted(sizes.items()))


def copy_regular_files(source: Path, destination: Path) -> None:
    """Copy the regular files under ``source`` into ``destination`` (created as needed);
    a link met on the way raises (callers check :func:`irregular_entries` first)."""
    for parent, _, files in os.walk(source):
        target = destination / Path(parent).relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        for name in sorted(files):
            path = Path(parent) / name
            if not stat.S_ISREG(path.lstat().st_mode):
                raise OSError(f"{path} is not a regular file: not copied")
            shutil.copyfile(path, target / name, follow_symlinks=False)


def damage(path: str | Path) -> list[str]:
    """What is wrong with a complete checkpoint's files: links inside it, files missing or of
    another size than when saved (checkpoints of earlier versions list no files: only the
    metadata is checked)."""
    path = Path(path)
    problems = [f"{entry} is refused" for entry in irregular_entries(path)]
    if problems:
        return problems
    try:
        listed = json.loads((path / METADATA_FILE).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError) as error:
        return [f"{METADATA_FILE} unreadable ({error})"]
    for name, size in listed.items():
        file = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            problems.append(f"{METADATA_FILE} lists {name}, outside the checkpoint")
        elif not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} has {file.stat().st_size} bytes, {size} when saved")
    return problems
