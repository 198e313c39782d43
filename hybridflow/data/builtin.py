"""`builtin:<task>` data files: synthetic tasks generated in memory instead of read from disk.

`data.train_files: [builtin:arithmetic]` and `data.val_files: [builtin:arithmetic]` give
disjoint train and validation prompts, the same on every run with the same seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hybridflow.config import ConfigError
from hybridflow.data.arithmetic import arithmetic_row, arithmetic_splits
from hybridflow.data.calc import calc_row, calc_splits
from hybridflow.data.countdown import countdown_problem, countdown_row
from hybridflow.data.schema import PromptRecord, iter_prompt_records, validate_row
from hybridflow.data.shapes import shapes_row, shapes_splits

BUILTIN_PREFIX = "builtin:"
BUILTIN_TASKS = ("arithmetic", "countdown", "calc", "shapes")
IMAGE_TASKS = ("shapes",)
"""Tasks whose prompts hold images (a vision-language model's: the tiny-vl preset)."""


def builtin_rows(
    task: str, split: str, train_size: int, val_size: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Rows of the `split` ("train" or "test") of a built-in task, in verl's schema."""
    if task not in BUILTIN_TASKS:
        raise ConfigError([f"unknown built-in task {task!r}; expected one of {BUILTIN_TASKS}"])
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if task == "arithmetic":
        problems = arithmetic_splits(train_size, val_size, seed)[split]
        return [arithmetic_row(q, a, split, i) for i, (q, a) in enumerate(problems)]
    if task == "calc":
        problems = calc_splits(train_size, val_size, seed)[split]
        return [calc_row(q, a, split, i) for i, (q, a) in enumerate(problems)]
    if task == "shapes":
        problems = shapes_splits(train_size, val_size, seed)[split]
        return [shapes_row(p, q, a, split, i) for i, (p, q, a) in enumerate(problems)]
    rng = random.Random(seed if split == "train" else seed + 1)
    size = train_size if split == "train" else val_size
    rows = []
    for index in range(size):
        numbers, target, _ = countdown_problem(rng)
        rows.append(countdown_row(numbers, target, split, index))
    return rows


def iter_records(
    files: str | Path | Sequence[str | Path],
    split: str = "train",
    known_data_sources: Iterable[str] | None = None,
    prompt_key: str = "prompt",
    builtin_train_size: int = 4000,
    builtin_val_size: int = 200,
    seed: int = 0,
    image_key: str | None = None,
) -> Iterator[PromptRecord]:
    """Records of data files and/or `builtin:<task>` entries, validated, as they are read;
    with image_key, each row's images too (a vision-language model's)."""
    if isinstance(files, (str, Path)):
        files = [files]
    known = None if known_data_sources is None else frozenset(known_data_sources)
    for entry in files:
        entry = str(entry)
        if entry.startswith(BUILTIN_PREFIX):
            task = entry[len(BUILTIN_PREFIX) :]
            rows = builtin_rows(task, split, builtin_train_size, builtin_val_size, seed)
            for i, row in enumerate(rows):
                yield validate_row(row, f"{entry}[{split}] row {i}", known, image_key=image_key)
        else:
            yield from iter_prompt_records(entry, known, prompt_key, image_key)


def load_records(*args: Any, **kwargs: Any) -> list[PromptRecord]:
    """Every record of :func:`iter_records` (same arguments), in a list."""
    return list(iter_records(*args, **kwargs))
