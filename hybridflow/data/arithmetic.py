"""The built-in `arithmetic` task: short integer problems a tiny char-level model can learn.

A prompt is one user message such as `23+45=`; the expected response is the bare answer
`68` (then end of turn). Prompts are <= 7 characters and answers <= 5 (two-digit
operands), so a ~1M-parameter model learns the format from a brief SFT and is then only
partly right on the digits (carries are the hard part), leaving room for RL to improve.
Generation is a pure function of the seed; the test split never overlaps the train split.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.data.schema import write_rows
from hybridflow.errors import UserError

ARITHMETIC_DATA_SOURCE = "arithmetic"
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_problem(
    rng: random.Random, operations: Sequence[str] = ("+",), max_operand: int = 99
) -> tuple[str, str]:
    """One `(question, answer)` pair, e.g. `("23+45=", "68")`."""
    operation = rng.choice(list(operations))
    if operation not in OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}; expected one of {list(OPERATIONS)}")
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return f"{a}{operation}{b}=", str(OPERATIONS[operation](a, b))


def arithmetic_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """The verl-schema row of one problem."""
    return {
        "data_source": ARITHMETIC_DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }


def arithmetic_problems(
    num: int,
    seed: int,
    operations: Sequence[str] = ("+",),
    max_operand: int = 99,
    exclude: frozenset[str] = frozenset(),
    unique: bool = False,
) -> list[tuple[str, str]]:
    """`num` problems drawn with `random.Random(seed)`, skipping questions in `exclude`."""
    rng = random.Random(seed)
    problems: list[tuple[str, str]] = []
    seen: set[str] = set()
    attempts = 0
    while len(problems) < num:
        attempts += 1
        if attempts > 100 * num + 1000:
            raise UserError(
                f"cannot draw {num} problems with max_operand={max_operand} outside the "
                f"excluded set; raise max_operand or ask for fewer problems"
            )
        question, answer = arithmetic_problem(rng, operations, max_operand)
        if question in exclude or (unique and question in seen):
            continue
        seen.add(question)
        problems.append((question, answer))
    return problems


def arithmetic_splits(
    train_size: int,
    test_size: int,
    seed: int = 0,
    operations: Sequence[str] = ("+",),
    max_operand: int = 99,
) -> dict[str, list[tuple[str, str]]]:
    """Train and test problems; test questions are unique and never appear in train."""
    test = arithmetic_problems(test_size, seed + 1_000_003, operations, max_operand, unique=True)
    held_out = frozenset(question for question, _ in test)
    train = arithmetic_problems(train_size, seed, operations, max_operand, exclude=held_out)
    return {"train": train, "test": test}


def sft_row(question: str, answer: str) -> dict[str, Any]:
    """One prompt/response row for supervised warm-start (see `hybridflow.data.sft_examples`)."""
    return {
        "data_source": ARITHMETIC_DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "response": answer,
    }


def write_arithmetic_dataset(
    out_dir: str | Path,
    train_size: int = 2000,
    test_size: int = 200,
    sft_size: int = 2000,
    seed: int = 0,
    operations: Sequence[str] = ("+",),
    max_operand: int = 99,
    file_format: str = "parquet",
) -> dict[str, Path]:
    """Write `train`, `test` (verl schema) and `sft` (prompt/response) files into `out_dir`.

    The SFT problems are drawn with their own seed, also outside the test split, so the
    warm-start never sees a validation question.
    """
    splits = arithmetic_splits(train_size, test_size, seed, operations, max_operand)
    held_out = frozenset(question for question, _ in splits["test"])
    sft = arithmetic_problems(sft_size, seed + 2_000_003, operations, max_operand, held_out)
    out_dir = Path(out_dir)
    paths = {}
    for split in ("train", "test"):
        rows = [arithmetic_row(q, a, split, i) for i, (q, a) in enumerate(splits[split])]
        paths[split] = write_rows(rows, out_dir / f"{split}.{file_format}")
    paths["sft"] = write_rows([sft_row(q, a) for q, a in sft], out_dir / f"sft.{file_format}")
    return paths
