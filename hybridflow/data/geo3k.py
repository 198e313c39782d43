"""Conversion of Geometry3K (`hiyouga/geometry3k`) to verl's schema, with its figures.

Input rows are the Hub's (`problem`, `answer`, `images`: a list of `{"bytes", "path"}`,
the problem starting with `<image>`) or rows verl's examples/data_preprocess/geo3k.py
already wrote (`prompt`, `reward_model`, `images`). Each output row is verl's::

    {"data_source": "hiyouga/geometry3k",
     "prompt": [{"role": "user", "content": "<image>Find x. You FIRST think ..."}],
     "images": [{"bytes": b"\\x89PNG...", "path": None}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "2\\sqrt{3}"},
     "extra_info": {"split": "train", "index": 0, "answer": ..., "question": ...}}

A problem without `<image>` gets one in front for each image, as the data path needs one
placeholder an image. Every image is decoded once to check it (data/images.py); a row
without an image, or with one that cannot be used, is refused naming the file and the
row. Images given as paths are embedded as bytes, so the output stands on its own. Rows
are read and written in batches of rows or of image bytes (memory holds a batch, not the
file), into a temporary file renamed when every row passed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

from hybridflow.data.images import ImageEntry
from hybridflow.data.schema import DataSchemaError, iter_rows, validate_row
from hybridflow.rewards.scorers.geo3k import GEO3K_DATA_SOURCE

INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide "
    "the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
    "The final answer MUST BE put in \\boxed{}."
)
"""verl's wording (its geo3k preprocessing), appended to each problem after a space."""
IMAGE_KEY = "images"
WRITE_BATCH_ROWS = 256
WRITE_BATCH_BYTES = 64 * 2**20
"""A batch is written once it holds this many bytes of images, even short of its rows."""
_HUB_SHARD = re.compile(r"^(?P<split>.+?)-\d+-of-\d+$")


class Geo3kConversion(NamedTuple):
    path: Path
    rows: int
    images: int
    first_ground_truth: str


def split_name(path: Path) -> str:
    """`train.parquet` -> train; the Hub's `test-00000-of-00001.parquet` -> test."""
    stem = path.name.split(".")[0]
    shard = _HUB_SHARD.match(stem)
    return shard.group("split") if shard else stem or "train"


def _text(value: Any, where: str, key: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise DataSchemaError(f"{where}: key '{key}' must be a non-empty string, got {value!r}")
    return value.strip()


def _source_fields(source: Any, where: str) -> tuple[list[dict], str, str]:
    """(prompt messages, ground truth, question) of a Hub row or a verl-schema row."""
    if not isinstance(source, dict):
        raise DataSchemaError(f"{where}: row must be an object, got {type(source).__name__}")
    images = source.get(IMAGE_KEY)
    if images is None or (isinstance(images, (list, tuple)) and not images):
        raise DataSchemaError(
            f"{where}: key '{IMAGE_KEY}' holds no image; each geo3k problem is about a figure",
            "add the row's image or leave the row out",
        )
    count = len(images) if isinstance(images, (list, tuple)) else 1
    if source.get("problem") is not None:  # a parquet file gives absent columns as None
        question = _text(source["problem"], where, "problem")
        marks = "" if "<image>" in question else "<image>" * count
        prompt = [{"role": "user", "content": f"{marks}{question} {INSTRUCTION}"}]
        return prompt, _text(source.get("answer"), where, "answer"), question
    if source.get("prompt") is not None and isinstance(source.get("reward_model"), dict):
        truth = _text(
            source["reward_model"].get("ground_truth"), where, "reward_model.ground_truth"
        )
        extra = source.get("extra_info") if isinstance(source.get("extra_info"), dict) else {}
        return source["prompt"], truth, str(extra.get("question") or "")
    raise DataSchemaError(
        f"{where}: neither a Geometry3K row ('problem', 'answer', 'images') nor one in verl's "
        f"schema ('prompt', 'reward_model', 'images'); keys: {sorted(source)}"
    )


def _embedded(image: ImageEntry) -> dict[str, Any]:
    data = image.source if isinstance(image.source, bytes) else Path(image.source).read_bytes()
    return {"bytes": data, "path": None}


def geo3k_row(source: Any, where: str, split: str, index: int, base_dir: Path) -> dict[str, Any]:
    """One input row -> a checked verl row (its images decoded once, then kept encoded)."""
    prompt, truth, question = _source_fields(source, where)
    row = {"data_source": GEO3K_DATA_SOURCE, "prompt": prompt, IMAGE_KEY: source[IMAGE_KEY],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth}}  # fmt: skip
    record = validate_row(row, where, image_key=IMAGE_KEY, base_dir=base_dir)
    return {
        **record.to_row(),
        IMAGE_KEY: [_embedded(image) for image in record.images],
        "extra_info": {"split": split, "index": index, "answer": truth, "question": question},
    }


def _schema():
    import pyarrow as pa

    text = pa.string()
    return pa.schema(
        [
            ("data_source", text),
            ("prompt", pa.list_(pa.struct([("role", text), ("content", text)]))),
            (IMAGE_KEY, pa.list_(pa.struct([("bytes", pa.binary()), ("path", text)]))),
            ("ability", text),
            ("reward_model", pa.struct([("style", text), ("ground_truth", text)])),
            (
                "extra_info",
                pa.struct(
                    [("split", text), ("index", pa.int64()), ("answer", text), ("question", text)]
                ),
            ),  # fmt: skip
        ]
    )


def _image_bytes(row: dict) -> int:
    return sum(len(image["bytes"]) for image in row[IMAGE_KEY])


def _batches(rows: Iterable[dict], size: int, max_bytes: int) -> Iterator[list[dict]]:
    """Rows in batches of ``size``, or fewer once their images take ``max_bytes``."""
    batch, held = [], 0
    for row in rows:
        batch.append(row)
        held += _image_bytes(row)
        if len(batch) == size or held >= max_bytes:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


def convert_geo3k_file(
    input_path: str | Path, out_dir: str | Path, split: str | None = None
) -> Geo3kConversion:
    """Convert one Geometry3K file (parquet or jsonl) into `out_dir/<split>.parquet`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    input_path = Path(input_path)
    split = split or split_name(input_path)
    source_rows = iter_rows(input_path)
    first_source = next(source_rows, None)  # a missing or empty file fails before any write
    if first_source is None:
        raise DataSchemaError(f"{input_path}: file holds no rows")
    rows = (geo3k_row(source, where, split, index, input_path.parent)
            for index, (where, source) in enumerate(chain([first_source], source_rows)))  # fmt: skip
    out = Path(out_dir) / f"{split}.parquet"
    partial = out.with_name(f".{out.name}.partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    counts, first, schema = {"rows": 0, "images": 0}, None, _schema()
    try:
        with pq.ParquetWriter(partial, schema) as writer:
            for batch in _batches(rows, WRITE_BATCH_ROWS, WRITE_BATCH_BYTES):
                first = first or batch[0]["reward_model"]["ground_truth"]
                counts["rows"] += len(batch)
                counts["images"] += sum(len(row[IMAGE_KEY]) for row in batch)
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return Geo3kConversion(out, counts["rows"], counts["images"], first)
