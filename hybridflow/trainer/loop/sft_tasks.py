"""The built-in tasks as SFT data: demonstrations of arithmetic (optionally careless about
carries) and tool-use traces of calc, and the problems of the greedy-accuracy check; none
from the task's validation split, so RL's before/after numbers stay unseen. Read by
``hybridflow sft`` (sft_loop.py) and the warm start (warm_start.py)."""

from __future__ import annotations

from hybridflow.config import ConfigError, SFTConfig


def without_carry(question: str) -> str | None:
    """The answer of ``a+b=`` with every carry dropped (digit-wise sums mod 10); None for
    other operations."""
    if "+" not in question:
        return None
    left, right = question.rstrip("=").split("+")
    a, b = int(left), int(right)
    digits, place = 0, 1
    while a or b:
        digits += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return str(digits)


def builtin_sft_rows(task: str, sft_cfg: SFTConfig, val_size: int, data_seed: int = 0):
    """Prompt/response rows for SFT on a built-in task, never from its validation split."""
    import random

    from hybridflow.data.arithmetic import arithmetic_problems, arithmetic_splits

    if task == "calc":
        return calc_sft_rows(sft_cfg, val_size, data_seed)
    if task != "arithmetic":
        raise ConfigError(
            [
                f"sft.train_files has builtin:{task}, but only builtin:arithmetic and builtin:calc "
                "have SFT demonstrations; give a prompt/response file for other tasks"
            ]
        )
    held_out = frozenset(q for q, _ in arithmetic_splits(0, val_size, data_seed)["test"])
    problems = arithmetic_problems(sft_cfg.builtin_size, data_seed + 2_000_003, exclude=held_out)
    rng = random.Random(data_seed + 17)
    rows = []
    for question, answer in problems:
        careless = without_carry(question)
        if careless is not None and careless != answer and rng.random() < sft_cfg.carry_error_rate:
            answer = careless
        rows.append((user_turn(question), answer))
    return rows


def calc_sft_rows(sft_cfg: SFTConfig, val_size: int, data_seed: int = 0) -> list[list[dict]]:
    """Tool-use traces of the calc task (chat messages: loss on the assistant turns), never
    from its validation split; `sft.miscopy_rate` of them miscopy a digit (data/calc.py)."""
    import random

    from hybridflow.data.calc import calc_problems, calc_splits, calc_trace

    held_out = frozenset(q for q, _ in calc_splits(0, val_size, data_seed)["test"])
    problems = calc_problems(sft_cfg.builtin_size, data_seed + 2_000_003, held_out)
    rng = random.Random(data_seed + 17)
    return [calc_trace(question, rng, sft_cfg.miscopy_rate) for question, _ in problems]


def accuracy_problems(task: str, size: int, val_size: int, data_seed: int = 0):
    """``size`` (question, answer) pairs of the built-in task for the greedy-accuracy check of
    ``sft.stop_at_accuracy``, never from its validation split (the RL before/after numbers)."""
    from hybridflow.data.arithmetic import arithmetic_problems, arithmetic_splits

    if task == "calc":
        from hybridflow.data.calc import calc_problems, calc_splits

        held_out = frozenset(q for q, _ in calc_splits(0, val_size, data_seed)["test"])
        return calc_problems(size, data_seed + 3_000_017, held_out)
    if task != "arithmetic":
        raise ConfigError([f"sft.stop_at_accuracy: no built-in accuracy check for {task!r}"])
    held_out = frozenset(q for q, _ in arithmetic_splits(0, val_size, data_seed)["test"])
    return arithmetic_problems(size, data_seed + 3_000_017, exclude=held_out)


def user_turn(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]
