"""Prompt data in verl's schema: reading, validating and writing parquet / jsonl files.

One row of a prompt file (the layout verl users already have on disk)::

    {
      "data_source": "openai/gsm8k",                       # picks the reward scorer
      "prompt": [{"role": "user", "content": "..."}],      # chat messages
      "ability": "math",                                   # optional, free text
      "reward_model": {"style": "rule", "ground_truth": "72"},
      "extra_info": {"split": "train", "index": 0},        # optional, passed to the scorer
    }

Every problem is reported as a `DataSchemaError` whose message names the file, the row
(parquet rows are 0-based, jsonl lines 1-based) and the key, so a user can fix the file
before any model is loaded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.data.errors import DataSchemaError

REQUIRED_KEYS = ("data_source", "prompt", "reward_model")
CHAT_ROLES = ("system", "user", "assistant", "tool")
SUPPORTED_SUFFIXES = (".parquet", ".jsonl", ".json")


@dataclass(frozen=True)
class PromptRecord:
    """One validated prompt row."""

    data_source: str
    prompt: list[dict[str, str]]
    """Chat messages, each {"role": ..., "content": ...}."""
    ground_truth: Any
    """`reward_model.ground_truth`: a string for most tasks, a dict for countdown."""
    ability: str = ""
    reward_style: str = "rule"
    extra_info: dict[str, Any] = field(default_factory=dict)
    where: str = field(default="", compare=False)
    """Human-readable location (`file: row N`), used in later error messages."""
    images: tuple = ()
    """The row's images (data.image_key), each checked and kept encoded
    (data/images.ImageEntry), in the order of the prompt's ``<image>`` placeholders."""

    def to_row(self) -> dict[str, Any]:
        """The verl-schema dict for this record (the inverse of `validate_row`)."""
        row = {
            "data_source": self.data_source,
            "prompt": [dict(m) for m in self.prompt],
            "ability": self.ability,
            "reward_model": {"style": self.reward_style, "ground_truth": self.ground_truth},
            "extra_info": dict(self.extra_info),
        }
        if self.images:  # under verl's default image_key
            row["images"] = [{"bytes": image.source, "path": None} if isinstance(image.source, bytes)
                             else {"bytes": None, "path": image.source} for image in self.images]  # fmt: skip
        return row


def _check_suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataSchemaError(
            f"{path}: unsupported file type {suffix!r}; use one of {', '.join(SUPPORTED_SUFFIXES)}"
        )
    return suffix


def iter_rows(path: str | Path, required_keys: Sequence[str] = ()) -> Iterator[tuple[str, Any]]:
    """Yield `(where, row)` for each row of a parquet or jsonl file.

    `required_keys` are checked as columns of a parquet file up front, so a missing
    column is one error instead of one per row. Rows of jsonl files are not checked here.
    """
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in SUPPORTED_SUFFIXES)
        example = f" (here: {', '.join(inside[:3])})" if inside else ""
        raise DataSchemaError(
            f"{path}: is a directory, not a data file",
            f"list the files in it, e.g. data.train_files=[{path}/part-0.parquet]{example}",
        )
    if not path.is_file():
        raise DataSchemaError(f"{path}: data file does not exist", "check the path")
    suffix = _check_suffix(path)
    if suffix == ".parquet":
        yield from _parquet_rows(path, required_keys)
        return
    yield from _jsonl_rows(path, MAX_ROW_BYTES)


MAX_ROW_BYTES = 256 << 20
"""The longest jsonl line read: a row is parsed whole (its bytes, text and objects: about six
times the line at peak), so a cap on the line is what bounds memory whatever the file holds.
256 MiB holds three 64 MiB images as base64 (data/images.py caps an image at 64 MiB)."""


def _jsonl_rows(path: Path, max_row_bytes: int) -> Iterator[tuple[str, Any]]:
    """(where, row) of each line of a jsonl file, a line over max_row_bytes refused before
    more than that is read."""
    with path.open("rb") as handle:
        for line_number, raw in enumerate(iter(lambda: handle.readline(max_row_bytes + 1), b""),
                                          start=1):  # fmt: skip
            where = f"{path}: line {line_number}"
            if len(raw) > max_row_bytes:
                raise DataSchemaError(
                    f"{where}: longer than {max_row_bytes >> 20} MiB, more than a row may take",
                    "shorten or drop that row; give large images as file paths, not bytes",
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataSchemaError(
                    f"{where}: not valid UTF-8 (byte {error.start + 1} of the line)",
                    "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataSchemaError(f"{where}: not valid JSON ({error.msg})") from error
            except RecursionError:  # brackets nested thousands deep
                raise DataSchemaError(f"{where}: JSON nested too deeply to be a row") from None
            except ValueError:  # an integer of more digits than Python converts (4300)
                raise DataSchemaError(f"{where}: holds a number of thousands of digits, "
                                      "which no row needs") from None  # fmt: skip
            yield where, row


PARQUET_BATCH_ROWS = 1024
"""Rows of a parquet file made Python objects at once: memory holds a batch, not the file."""


def _parquet_rows(path: Path, required_keys: Sequence[str]) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        columns = parquet.schema_arrow.names
    except Exception as error:  # pyarrow raises several types for corrupt files
        raise DataSchemaError(f"{path}: cannot read parquet file ({error})") from error
    missing = [key for key in required_keys if key not in columns]
    if missing:
        raise DataSchemaError(f"{path}: missing column(s) {missing}; columns present: {columns}")
    batches = parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS)
    index = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as error:  # a corrupt row group, found when it is read
            raise DataSchemaError(f"{path}: cannot read parquet file ({error})") from error
        if batch is None:
            return
        for row in batch.to_pylist():
            yield f"{path}: row {index}", row
            index += 1


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, where: str, key: str) -> str:
    """`text`, refused when it holds a lone UTF-16 surrogate: an unpaired "\\ud800" escape in
    a jsonl line decodes to one, which no tokenizer takes (a traceback in the run)."""
    found = None if text.isascii() else _LONE_SURROGATE.search(text)
    if found:
        raise DataSchemaError(
            f"{where}: key '{key}' holds a lone UTF-16 surrogate "
            f"({found.group().encode('unicode_escape').decode()} at character {found.start()}), "
            "which is no Unicode text",
            "write characters outside the BMP as a surrogate pair (\\ud83d\\ude00) or as UTF-8",
        )
    return text


def validate_messages(messages: Any, where: str, key: str) -> list[dict[str, str]]:
    if isinstance(messages, str) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise DataSchemaError(
            f"{where}: key '{key}' must be a non-empty list of chat messages "
            f"{{'role', 'content'}}, got {type(messages).__name__}"
        )
    validated = []
    for position, message in enumerate(messages):
        message_key = f"{key}[{position}]"
        if not isinstance(message, dict):
            raise DataSchemaError(
                f"{where}: key '{message_key}' must be a dict with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise DataSchemaError(
                f"{where}: key '{message_key}.role' is {role!r}; expected one of {CHAT_ROLES}"
            )
        if not isinstance(content, str):
            raise DataSchemaError(
                f"{where}: key '{message_key}.content' must be a string, "
                f"got {type(content).__name__}"
            )
        validated.append(
            {"role": role, "content": check_text(content, where, f"{message_key}.content")}
        )
    return validated


def validate_row(
    row: Any,
    where: str,
    known_data_sources: Iterable[str] | None = None,
    prompt_key: str = "prompt",
    image_key: str | None = None,
    base_dir: str | Path = ".",
) -> PromptRecord:
    """Check one row against the schema and return it as a `PromptRecord`.

    `known_data_sources`, when given (e.g. the keys of a scorer registry), rejects rows
    whose `data_source` no scorer handles. `image_key`: the column of the row's images
    (data/images.py: each decoded once and checked, one ``<image>`` in the prompt each;
    relative paths from `base_dir`, the data file's directory).
    """
    if not isinstance(row, dict):
        raise DataSchemaError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    for key in ("data_source", prompt_key, "reward_model"):
        if key not in row or row[key] is None:
            raise DataSchemaError(f"{where}: missing key '{key}' (present: {sorted(row)})")
    data_source = row["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise DataSchemaError(f"{where}: key 'data_source' must be a non-empty string")
    if known_data_sources is not None:
        known = sorted(known_data_sources)
        if data_source not in known:
            raise DataSchemaError(
                f"{where}: unknown data_source {data_source!r}; no reward scorer is registered "
                f"for it (known: {known}); register one or set reward.custom_fn"
            )
    messages = row[prompt_key]
    if isinstance(messages, str):  # a plain-text prompt is one user turn
        messages = [{"role": "user", "content": messages}]
    messages = validate_messages(messages, where, prompt_key)
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict):
        raise DataSchemaError(f"{where}: key 'reward_model' must be a dict with 'ground_truth'")
    if reward_model.get("ground_truth") is None:
        raise DataSchemaError(f"{where}: missing key 'reward_model.ground_truth'")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataSchemaError(
            f"{where}: key 'extra_info' must be a dict, got {type(extra_info).__name__}"
        )
    ability = row.get("ability") or ""
    images = ()
    if image_key is not None:
        from hybridflow.data.images import check_placeholders, row_image_entries

        images = row_image_entries(row, image_key, where, base_dir)
        check_placeholders(messages, len(images), where, image_key)
    return PromptRecord(
        data_source=data_source,
        prompt=messages,
        ground_truth=reward_model["ground_truth"],
        ability=str(ability),
        reward_style=str(reward_model.get("style") or "rule"),
        extra_info=dict(extra_info),
        where=where,
        images=images,
    )


def iter_prompt_records(
    paths: str | Path | Sequence[str | Path],
    known_data_sources: Iterable[str] | None = None,
    prompt_key: str = "prompt",
    image_key: str | None = None,
) -> Iterator[PromptRecord]:
    """Each validated row of one or more prompt files (parquet or jsonl), as it is read;
    with `image_key`, each row's images too (validate_row)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    known = None if known_data_sources is None else frozenset(known_data_sources)
    for path in paths:
        required = ("data_source", prompt_key, "reward_model")
        rows = 0
        for where, row in iter_rows(path, required_keys=required):
            rows += 1
            yield validate_row(row, where, known, prompt_key, image_key, Path(path).parent)
        if not rows:
            raise DataSchemaError(
                f"{path}: file holds no rows",
                "add rows in the prompt schema (data_source, prompt, reward_model) or leave "
                "the file out of the list",
            )


def load_prompt_records(
    paths: str | Path | Sequence[str | Path],
    known_data_sources: Iterable[str] | None = None,
    prompt_key: str = "prompt",
) -> list[PromptRecord]:
    """Read and validate every row of one or more prompt files (parquet or jsonl)."""
    return list(iter_prompt_records(paths, known_data_sources, prompt_key))


def write_rows(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to `path`; the suffix (.parquet or .jsonl) picks the format."""
    path = Path(path)
    suffix = _check_suffix(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    else:
        with path.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_records(records: Sequence[PromptRecord], path: str | Path) -> Path:
    """Write validated records back to disk in verl's schema."""
    return write_rows([record.to_row() for record in records], path)
