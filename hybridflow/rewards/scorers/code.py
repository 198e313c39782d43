"""Code: the response's Python program, run on the row's stdin/stdout test cases.

ground_truth is `{"inputs": [...], "outputs": [...]}` (a dict or its JSON text, the form
CodeContests-style datasets use): test i feeds inputs[i] on stdin and expects outputs[i]
on stdout, compared after stripping the text and each line's trailing whitespace. The
score is the fraction of tests passed; a test passes only if the program also exits 0.

Every test runs as its own program in the sandbox (hybridflow/agents/sandbox.py), so a
program that loops, crashes or floods its output costs at most one time limit per test
and never raises. After the first test that times out, the tests not yet started are
counted as failed without running them: a program too slow for one input is usually too
slow for the rest, and running them all could take `len(tests) * timeout_s`.

Options (scorer options or per-row `extra_info`, the row's winning): timeout_s (per test,
default 5), memory_bytes, concurrency (tests run at once), stop_on_timeout. A scorer
option only: isolation (SandboxLimits.isolation; `reward.sandbox_isolation`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from hybridflow.agents.sandbox import Sandbox, SandboxLimits, SandboxResult, run_blocking

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 1 << 30
_FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")
_PYTHON_TAGS = {"python", "python3", "py"}


def extract_program(solution_str: str) -> str:
    """The last ```python fenced block; else the last untagged fenced block; else the
    whole text (a response that is only code). An unclosed last block runs to the end."""
    blocks: list[tuple[str, list[str]]] = []
    current: tuple[str, list[str]] | None = None
    for line in solution_str.splitlines():
        fence = _FENCE.match(line)
        if current is None:
            if fence:
                current = (fence.group(1).lower(), [])
        elif fence and not fence.group(1):
            blocks.append(current)
            current = None
        else:
            current[1].append(line)
    if current is not None:
        blocks.append(current)
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [lines for tag, lines in blocks if wanted(tag)]
        if chosen:
            return "\n".join(chosen[-1]) + "\n"
    return solution_str


def _as_list(value: Any, key: str) -> list:
    if hasattr(value, "tolist"):  # numpy arrays from a parquet column
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"code ground_truth[{key!r}] must be a list, got {type(value).__name__}")
    return list(value)


def parse_tests(ground_truth: Any) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a row; ValueError names what is wrong with a malformed one."""
    data = ground_truth
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as error:
            raise ValueError(f"code ground_truth is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(
            'code ground_truth must be {"inputs": [...], "outputs": [...]}, '
            f"got {type(data).__name__}"
        )
    if data.get("fn_name"):
        raise ValueError(
            f"code ground_truth calls function {data['fn_name']!r}: only stdin/stdout tests "
            f"are supported"
        )
    missing = [key for key in ("inputs", "outputs") if key not in data]
    if missing:
        raise ValueError(f"code ground_truth has no {' or '.join(missing)}; keys: {sorted(data)}")
    inputs, outputs = _as_list(data["inputs"], "inputs"), _as_list(data["outputs"], "outputs")
    if len(inputs) != len(outputs):
        raise ValueError(f"code ground_truth has {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("code ground_truth has no test cases")
    for key, values in (("inputs", inputs), ("outputs", outputs)):
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise ValueError(
                    f"code ground_truth[{key!r}][{i}] must be a string, got {type(value).__name__}"
                )
    return inputs, outputs


def normalize_output(text: str) -> str:
    """Stripped text, trailing whitespace of each line removed, line ends unified."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _passed(result: SandboxResult, expected: str) -> bool:
    return result.status == "ok" and normalize_output(result.stdout) == normalize_output(expected)


async def _run_tests(
    sandbox: Sandbox, program: str, inputs: Sequence[str], stop_on_timeout: bool
) -> list[SandboxResult | None]:
    timed_out = False

    async def one(stdin_text: str) -> SandboxResult | None:
        nonlocal timed_out
        async with gate:
            if timed_out and stop_on_timeout:
                return None  # not run: counted as failed
            result = await sandbox.run(program, stdin_text)
            timed_out = timed_out or result.status == "timeout"
            return result

    gate = asyncio.Semaphore(sandbox.limits.concurrency)
    return list(await asyncio.gather(*(one(text) for text in inputs)))


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    concurrency: int | None = None,
    stop_on_timeout: bool = True,
    isolation: str = "auto",
    **_: object,
) -> float:
    """Fraction of the row's tests the response's program passes (0.0 to 1.0)."""
    inputs, outputs = parse_tests(ground_truth)
    options = extra_info if isinstance(extra_info, dict) else {}
    timeout_s = float(options.get("timeout_s", timeout_s))
    memory_bytes = int(options.get("memory_bytes", memory_bytes))
    concurrency = options.get("concurrency", concurrency) or min(4, os.cpu_count() or 1)
    stop_on_timeout = bool(options.get("stop_on_timeout", stop_on_timeout))
    program = extract_program(solution_str or "")
    if not program.strip():
        return 0.0
    longest = max(len(text.encode()) for text in outputs)
    limits = SandboxLimits(
        timeout_s=timeout_s,
        cpu_s=math.ceil(timeout_s) + 1,  # the wall clock decides; CPU is the backstop
        memory_bytes=memory_bytes,
        max_output_bytes=max(64 << 10, 2 * longest + 1024),
        concurrency=int(concurrency),
        isolation=isolation,  # the scorer's option only: a data row cannot weaken it
    )
    results = run_blocking(_run_tests(Sandbox(limits), program, inputs, stop_on_timeout))
    passed = sum(
        result is not None and _passed(result, expected)
        for result, expected in zip(results, outputs)
    )
    return passed / len(outputs)
