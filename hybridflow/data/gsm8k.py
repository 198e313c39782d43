"""Conversion of the original GSM8K release (`{"question", "answer"}`) to verl's schema.

The ground truth is the text after the last `####` of the answer, with thousands
separators removed (`1,000` -> `1000`). The prompt asks for the same `####` format that
the gsm8k scorer reads. Input may be the original jsonl or a parquet file with the same
two columns (the Hub layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridflow.data.schema import DataSchemaError, iter_rows, write_rows

GSM8K_DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def extract_gsm8k_answer(answer_text: str) -> str:
    """Final answer of a GSM8K solution: text after the last `####`, commas removed."""
    if "####" not in answer_text:
        raise ValueError("answer has no '####' marker")
    return answer_text.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_gsm8k_answer(answer)},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def convert_gsm8k_rows(source_rows: list[tuple[str, Any]], split: str) -> list[dict[str, Any]]:
    """`(where, {"question", "answer"})` pairs -> verl rows; errors name the row."""
    rows = []
    for index, (where, source) in enumerate(source_rows):
        if not isinstance(source, dict):
            raise DataSchemaError(f"{where}: row must be an object with 'question' and 'answer'")
        for key in ("question", "answer"):
            if not isinstance(source.get(key), str):
                raise DataSchemaError(f"{where}: missing or non-string key '{key}'")
        try:
            rows.append(gsm8k_row(source["question"], source["answer"], split, index))
        except ValueError as error:
            raise DataSchemaError(f"{where}: key 'answer': {error}") from error
    return rows


def _split_name(path: Path) -> str:
    stem = path.name.split(".")[0]
    return stem if stem else "train"


def convert_gsm8k_file(input_path: str | Path, out_dir: str | Path, split: str | None = None):
    """Convert one original GSM8K file; writes `out_dir/<split>.parquet` and returns its path.

    The split name defaults to the input's file name stem (`train.jsonl` -> `train`).
    """
    input_path = Path(input_path)
    split = split or _split_name(input_path)
    rows = convert_gsm8k_rows(list(iter_rows(input_path, ("question", "answer"))), split)
    if not rows:
        raise DataSchemaError(f"{input_path}: file holds no rows")
    return write_rows(rows, Path(out_dir) / f"{split}.parquet")


def convert_gsm8k_from_hub(out_dir: str | Path, name: str = "openai/gsm8k") -> list[Path]:
    """Download GSM8K with `datasets` and convert both splits (needs a network)."""
    try:
        import datasets
    except ImportError as error:
        raise RuntimeError(
            "--from-hub needs the `datasets` package (pip install datasets); or convert a "
            "local copy with --input FILE"
        ) from error
    try:
        dataset = datasets.load_dataset(name, "main")
    except Exception as error:  # network errors come in many types
        raise RuntimeError(
            f"could not download {name} from the Hugging Face Hub ({type(error).__name__}: "
            f"{error}); without a network, convert a local copy with --input FILE"
        ) from error
    paths = []
    for split in dataset:
        source_rows = [(f"{name}[{split}] row {i}", row) for i, row in enumerate(dataset[split])]
        rows = convert_gsm8k_rows(source_rows, split)
        paths.append(write_rows(rows, Path(out_dir) / f"{split}.parquet"))
    return paths


def describe(path: str | Path) -> str:
    """One line for the CLI: how many rows a converted file holds, and one example."""
    rows = list(iter_rows(path))
    first = rows[0][1]
    return f"{path}: {len(rows)} rows; first ground truth {json.dumps(first['reward_model'])}"
