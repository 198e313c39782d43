"""The built-in `countdown` task: reach a target with given numbers and + - * /.

Every problem is solvable: the target is the value of a random expression that uses each
number exactly once (exact division only, no negative intermediate values), and that
expression is kept as a reference solution for SFT. The ground truth is
`{"target": int, "numbers": [int, ...]}`, as in TinyZero-style countdown data, and the
answer goes between `<answer>` tags.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from hybridflow.data.schema import write_rows

COUNTDOWN_DATA_SOURCE = "countdown"
PROMPT_TEMPLATE = (
    "Using the numbers {numbers}, create an equation that equals {target}. "
    "Use each number exactly once and only + - * / and parentheses. "
    "Give the equation in <answer> </answer> tags, e.g. <answer>(1 + 2) * 3</answer>."
)


def _combine(rng: random.Random, left: tuple[int, str], right: tuple[int, str]):
    """Combine two (value, expression) pairs with a random valid operation, or None."""
    (a, expr_a), (b, expr_b) = left, right
    candidates = [("+", a + b), ("*", a * b)]
    if a >= b:
        candidates.append(("-", a - b))
    if b != 0 and a % b == 0:
        candidates.append(("/", a // b))
    operation, value = rng.choice(candidates)
    return value, f"({expr_a} {operation} {expr_b})"


def countdown_problem(
    rng: random.Random, num_numbers: int = 3, max_number: int = 20, max_target: int = 100
) -> tuple[list[int], int, str]:
    """`(numbers, target, solution)` with `1 <= target <= max_target`."""
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        pool = [(n, str(n)) for n in numbers]
        while len(pool) > 1:
            rng.shuffle(pool)
            left, right = pool.pop(), pool.pop()
            pool.append(_combine(rng, left, right))
        target, expression = pool[0]
        if 1 <= target <= max_target:
            # The outermost parentheses add nothing for a reader.
            return numbers, target, expression[1:-1] if num_numbers > 1 else expression


def countdown_row(numbers: list[int], target: int, split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": COUNTDOWN_DATA_SOURCE,
        "prompt": [
            {"role": "user", "content": PROMPT_TEMPLATE.format(numbers=numbers, target=target)}
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": numbers}},
        "extra_info": {"split": split, "index": index},
    }


def write_countdown_dataset(
    out_dir: str | Path,
    train_size: int = 2000,
    test_size: int = 200,
    seed: int = 0,
    num_numbers: int = 3,
    max_number: int = 20,
    max_target: int = 100,
    file_format: str = "parquet",
    with_sft: bool = True,
) -> dict[str, Path]:
    """Write `train` and `test` (verl schema) and, optionally, `sft` (reference solutions)."""
    out_dir = Path(out_dir)
    paths = {}
    sft_rows = []
    for split, size, split_seed in (("train", train_size, seed), ("test", test_size, seed + 1)):
        rng = random.Random(split_seed)
        rows = []
        for index in range(size):
            numbers, target, solution = countdown_problem(rng, num_numbers, max_number, max_target)
            row = countdown_row(numbers, target, split, index)
            rows.append(row)
            if split == "train":
                sft_rows.append(
                    {
                        "data_source": COUNTDOWN_DATA_SOURCE,
                        "prompt": row["prompt"],
                        "response": f"<answer>{solution}</answer>",
                    }
                )
        paths[split] = write_rows(rows, out_dir / f"{split}.{file_format}")
    if with_sft:
        paths["sft"] = write_rows(sft_rows, out_dir / f"sft.{file_format}")
    return paths
