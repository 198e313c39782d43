"""The built-in `calc` task: products too large for a tiny model to work out, easy with the
calculator tool. The prompt is `123*45=`; an episode that solves it calls
`calculator` with the expression, reads the result and answers with it:

    <|im_start|>u123*45=<|im_end|>
    <|im_start|>a<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call><|im_end|>
    <|im_start|>t5535<|im_end|>
    <|im_start|>a5535<|im_end|>

The SFT warm start learns that format from traces (`calc_trace`), some of them on purpose
with one digit of the expression miscopied (the tool then answers the wrong product and the
trace copies it), so the warm-started model is partly right and RL against the exact checker
has something to fix: multi-turn tool RL that runs on a laptop.
"""

from __future__ import annotations

import json
import random
from typing import Any

CALC_DATA_SOURCE = "calc"


def calc_problem(rng: random.Random) -> tuple[str, str]:
    """`("a*b=", str(a * b))` with a three-digit a and a two-digit b."""
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return f"{a}*{b}=", str(a * b)


def calc_problems(num: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[tuple]:
    rng = random.Random(seed)
    problems = []
    while len(problems) < num:
        question, answer = calc_problem(rng)
        if question not in exclude:
            problems.append((question, answer))
    return problems


def calc_splits(train_size: int, test_size: int, seed: int = 0) -> dict[str, list[tuple]]:
    """Train and test problems; test questions never appear in train."""
    test = list(dict.fromkeys(calc_problems(test_size * 2, seed + 1_000_003)))[:test_size]
    held_out = frozenset(question for question, _ in test)
    return {"train": calc_problems(train_size, seed, held_out), "test": test}


def calc_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": CALC_DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "ability": "tool-use",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }


def tool_call_text(expression: str) -> str:
    """The Hermes call of the calculator (what the parser reads back)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def calc_trace(question: str, rng: random.Random, miscopy_rate: float = 0.0) -> list[dict]:
    """The messages of a solved episode; with probability miscopy_rate one digit of the
    expression is miscopied (and the rest of the trace follows from that)."""
    expression = question.rstrip("=")
    if rng.random() < miscopy_rate:
        digits = [i for i, c in enumerate(expression) if c.isdigit()]
        at = rng.choice(digits)
        wrong = rng.choice([d for d in "0123456789" if d != expression[at]])
        expression = expression[:at] + wrong + expression[at + 1 :]
        if expression[0] == "0" or expression.split("*")[1].startswith("0"):
            expression = question.rstrip("=")  # no leading zeros: keep the right copy
    a, b = (int(part) for part in expression.split("*"))
    result = str(a * b)
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": tool_call_text(expression)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]
