"""Reading run directories: ``metrics.jsonl`` (one JSON object per step) and ``config.yaml``.

A run that is still going may have a last line cut in the middle: such a line is skipped, as
are lines that are not JSON objects with a ``step``. Steps logged twice (validation at step 0,
then the first step) are merged, later keys winning.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"


class RunDirError(ValueError):
    """A run directory cannot be reported; the message names it and what to do."""


@dataclass
class Run:
    name: str
    """Short label in legends: the directory name (with parents when two runs share it)."""
    path: Path
    steps: dict[int, dict[str, Any]]
    """Metrics by step, in step order."""
    config: dict[str, Any] | None = None
    """The resolved config (nested sections), None when the run wrote none."""
    skipped_lines: int = 0
    notes: list[str] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) where ``key`` has a finite number."""
        xs, ys = [], []
        for step, metrics in self.steps.items():
            value = metrics.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                xs.append(step)
                ys.append(float(value))
        return xs, ys

    def keys(self) -> set[str]:
        return {key for metrics in self.steps.values() for key in metrics}


def parse_metrics(lines: list[str]) -> tuple[dict[int, dict[str, Any]], int]:
    """({step: metrics}, number of lines skipped) from metrics.jsonl lines."""
    steps: dict[int, dict[str, Any]] = {}
    skipped = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            skipped += 1
            continue
        step = record.pop("step")
        steps.setdefault(step, {}).update(record)
    return dict(sorted(steps.items())), skipped


def read_run(path: str | Path, name: str | None = None) -> Run:
    """One run directory (``trainer.run_dir``); :class:`RunDirError` if it has no metrics."""
    path = Path(path)
    metrics = path / METRICS_FILE
    if not path.is_dir():
        raise RunDirError(f"{path}: no such directory; give the run's trainer.run_dir")
    if not metrics.is_file():
        raise RunDirError(
            f"{path}: no {METRICS_FILE}; is this a run directory (trainer.run_dir), and does "
            "trainer.loggers include jsonl?"
        )
    steps, skipped = parse_metrics(metrics.read_text(encoding="utf-8").splitlines())
    run = Run(name or path.name, path, steps, read_config(path), skipped)
    if not steps:
        run.notes.append(f"{METRICS_FILE} has no step yet")
    if run.config is None:
        run.notes.append(f"no {CONFIG_FILE}: its config is not shown")
    return run


def read_config(path: Path) -> dict[str, Any] | None:
    """``config.yaml`` of the run, else that of its newest checkpoint, else None."""
    import yaml

    from hybridflow.config.sections import ConfigError
    from hybridflow.config.yaml_limits import load_yaml

    candidates = [path / CONFIG_FILE]
    checkpoints = [p for p in (path / "checkpoints").glob("step_*/config.yaml")
                   if p.parent.name.removeprefix("step_").isdigit()]  # fmt: skip
    checkpoints.sort(key=lambda p: int(p.parent.name.removeprefix("step_")))
    candidates += checkpoints[::-1]
    for candidate in candidates:
        if candidate.is_file():
            try:  # bounded: a run directory's file may come from anyone
                data = load_yaml(candidate.read_text(encoding="utf-8"), source=str(candidate))
            except (yaml.YAMLError, ConfigError):
                continue
            if isinstance(data, dict):
                return data
    return None


def unique_names(paths: list[Path]) -> list[str]:
    """The shortest path suffixes that tell the runs apart: ``grpo``, or ``a/run``, ``b/run``."""
    resolved = [p.resolve() for p in paths]
    for depth in range(1, max(len(p.parts) for p in resolved) + 1):
        names = ["/".join(p.parts[-depth:]) for p in resolved]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


def read_runs(paths: list[str | Path]) -> list[Run]:
    paths = [Path(p) for p in paths]
    return [read_run(p, name) for p, name in zip(paths, unique_names(paths))]


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys: ``{"actor": {"lr": 1e-6}}`` -> ``{"actor.lr": 1e-6}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_differences(configs: list[dict[str, Any] | None]) -> dict[str, list[Any]]:
    """Dotted keys whose values differ between the configs (missing config: skipped), each
    with the value of every config (None where a config lacks the key)."""
    flats = [flatten(c) for c in configs if c is not None]
    if len(flats) < 2:
        return {}
    keys = sorted({key for flat in flats for key in flat})
    return {
        key: [flat.get(key) for flat in flats]
        for key in keys
        if len({json.dumps(flat.get(key), sort_keys=True, default=str) for flat in flats}) > 1
    }
