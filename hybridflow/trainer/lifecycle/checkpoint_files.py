"""The files of a checkpoint directory: regular files only, with their sizes and checksums.

A checkpoint is read by programs that trust what it points to (the loader, ``hybridflow
export``'s copy of the tokenizer), so a link inside it — to ``/etc/shadow``, to a folder of
5 GB — is refused, never followed, and named. ``damage`` says what is wrong with a complete
checkpoint's files compared with what ``metadata.json`` listed when it was saved: missing,
another size, or other content (random or zeroed bytes of the same size).

The checksum is CRC-32 (zlib): it finds accidental damage, which is what it is for (anyone
who can craft a checkpoint can also rewrite its checksums; the loaders refuse crafted files
on their own). It was the fastest one measured here: 2.8 GB/s on one core, against 1.2 for
SHA-256 and 0.9 for BLAKE2b (docs/performance.md), and files are hashed in parallel.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

METADATA_FILE = "metadata.json"
CHUNK_BYTES = 8 * 2**20
MAX_HASH_THREADS = 8


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
    return sorted(found)


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


def checksum(path: Path, chunk_bytes: int = CHUNK_BYTES) -> str:
    """``crc32:<8 hex digits>`` of the file's bytes (a link raises: it is never followed)."""
    buffer = memoryview(bytearray(chunk_bytes))
    crc = 0
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            crc = zlib.crc32(buffer[:count], crc)  # releases the GIL: files hash in parallel
    return f"crc32:{crc:08x}"


def checksums(directory: Path, names: list[str] | dict[str, int]) -> dict[str, str]:
    """``{name: checksum}`` of the files ``names`` under ``directory``, several at a time."""
    names = list(names)
    threads = max(1, min(len(names), os.cpu_count() or 1, MAX_HASH_THREADS))
    with ThreadPoolExecutor(threads, thread_name_prefix="checksum") as pool:
        digests = pool.map(lambda name: checksum(directory / name), names)
        return dict(zip(names, digests))


def has_checksums(path: Path) -> bool:
    """Whether the checkpoint's metadata.json holds content checksums (earlier versions'
    list sizes only)."""
    try:
        return "checksums" in json.loads((Path(path) / METADATA_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


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
    """What is wrong with a complete checkpoint's files: links inside it, files missing, of
    another size or with other content than when saved (reads every file). Checkpoints of
    earlier versions list no checksums (then sizes only) or no files (metadata only)."""
    path = Path(path)
    problems = [f"{entry} is refused" for entry in irregular_entries(path)]
    if problems:
        return problems
    try:
        info = json.loads((path / METADATA_FILE).read_text())
        listed, expected = dict(info.get("files", {})), dict(info.get("checksums", {}))
    except (OSError, ValueError, TypeError, AttributeError) as error:
        return [f"{METADATA_FILE} unreadable ({error})"]
    intact = []
    for name, size in listed.items():
        file = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            problems.append(f"{METADATA_FILE} lists {name}, outside the checkpoint")
        elif not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} has {file.stat().st_size} bytes, {size} when saved")
        elif name in expected:
            intact.append(name)
    for name, found in checksums(path, intact).items():
        if found != expected[name]:
            problems.append(
                f"{name} has other content than when saved (checksum {found}, "
                f"{expected[name]} when saved)"
            )
    return problems
