"""Where metrics go: console (rich), metrics.jsonl, TensorBoard, W&B.

`Tracker` fans one `log(metrics, step)` out to the backends named in `trainer.loggers`.
TensorBoard and W&B are imported only when asked for, with a message saying what to
install if they are missing.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridflow.config import ConfigError
from hybridflow.config.validation import LOGGER_NAMES
from hybridflow.errors import UserError
from hybridflow.install_hint import extra_install

# What the console table shows, in order, when present (short header, key). Two KLs: the
# update's drift from the policy that sampled (PPO's approx KL, `ppo_kl`), and the KL to the
# reference policy that verl users read as "kl" (`ref_kl`: the KL loss with
# actor.use_kl_loss, `ref_kl_pen`: the penalty in the reward with algorithm.use_kl_in_reward).
CONSOLE_COLUMNS = (
    ("score", "score/mean"),
    ("reward", "reward/mean"),
    ("resp_len", "response_length/mean"),
    ("clip", "response_length/clip_ratio"),
    ("pg_loss", "actor/pg_loss"),
    ("entropy", "actor/entropy"),
    ("ppo_kl", "actor/ppo_kl"),
    ("ref_kl", "actor/kl_loss"),
    ("ref_kl_pen", "actor/reward_kl_penalty"),
    ("grad", "actor/grad_norm"),
    ("tok/s/gpu", "perf/tokens_per_s_per_gpu"),
    ("step_s", "timing_s/step"),
)
THROUGHPUT = "tok/s/gpu"
THROUGHPUT_HEADERS = {"cuda": THROUGHPUT, "cpu": "tok/s/proc"}
"""The throughput column's header by device: tokens/s of one GPU, or of one CPU process
(each holds ``trainer.cpu_threads`` cores)."""


class LoggerUnavailable(UserError, RuntimeError):
    """A requested logging backend is not installed."""


def _is_scalar(value: Any) -> bool:
    if isinstance(value, (numbers.Number, str)) or value is None:
        return True
    size = getattr(value, "numel", None) or getattr(value, "size", None)
    size = size() if callable(size) else size
    return size == 1 and hasattr(value, "item")


def to_scalar(value: Any) -> float | int | str | None:
    """A JSON-friendly scalar: tensors and numpy numbers become numbers, NaN/inf None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, str)):
        return value
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    return None


def clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float | int | str | None]:
    """Scalars only (NaN/inf become None); lists, dicts and larger tensors are dropped."""
    return {key: to_scalar(value) for key, value in metrics.items() if _is_scalar(value)}


class JsonlLogger:
    """Appends one JSON object per step, `{"step": N, ...}`, to `path`.

    On resume from step K, lines with step > K (written after the checkpoint, before a
    crash) are dropped first, so the file reads as one uninterrupted run.
    """

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        self._handle = self.path.open("a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the crash
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(temporary, self.path)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        record = {"step": step, **clean_metrics(metrics)}
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


STEP_WIDTH, CELL_WIDTH = 6, 10
"""Characters per column of the step table: its width depends on the columns only, never on
the terminal, so a log file holds one line per step."""


def fit_cell(value: Any, width: int = CELL_WIDTH) -> str:
    """``value`` in at most ``width`` characters: 4 significant digits, fewer if needed."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for text in (str(value) if isinstance(value, int) else f"{value:.4g}", f"{value:.2g}"):
            if len(text) <= width:
                return text
        return f"{value:.0e}"[:width]
    return str(value)[:width]


def table_line(cells: Sequence[str]) -> str:
    """The step column, then fixed-width cells, right-aligned."""
    first, rest = cells[0], cells[1:]
    return " ".join([first.rjust(STEP_WIDTH), *(cell.rjust(CELL_WIDTH) for cell in rest)])


class ConsoleLogger:
    """A compact table, one fixed-width row per step; validation metrics on a line of their own.

    The columns are those of ``CONSOLE_COLUMNS`` the first step reports (a later step without
    one shows ``-``). The header is printed again every ``header_every`` rows, and after the
    Python warnings collected since the last row (printed first, so never between two rows).
    Lines go through the run's :class:`~hybridflow.progress.ProgressReporter`, above
    its progress bars.
    """

    def __init__(self, header_every: int = 20, console=None, progress=None, device: str = "cuda"):
        from hybridflow.progress import ProgressReporter

        self.progress = progress or ProgressReporter(console, live=False, tick_s=None)
        self.header_every, self.rows = header_every, 0
        self.columns: list[tuple[str, str]] | None = None
        self.throughput = THROUGHPUT_HEADERS.get(device, THROUGHPUT_HEADERS["cpu"])

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        metrics = clean_metrics(metrics)
        if self.columns is None:
            self.columns = [
                (self.throughput if name == THROUGHPUT else name, key)
                for name, key in CONSOLE_COLUMNS
                if key in metrics
            ] or None
        if self.columns and any(key in metrics for _, key in self.columns):
            warned = self.progress.flush_warnings()
            if warned or self.rows % self.header_every == 0:
                header = table_line(["step", *[name for name, _ in self.columns]])
                self.progress.print(header, style="bold")
            row = [str(step), *[fit_cell(metrics.get(key)) for _, key in self.columns]]
            self.progress.print(table_line(row))
            self.rows += 1
        validation = {k: v for k, v in metrics.items() if k.startswith("val/")}
        if validation:
            text = "  ".join(f"{k}={fit_cell(v)}" for k, v in sorted(validation.items()))
            self.progress.print(f"[step {step}] {text}")

    def close(self) -> None:
        self.progress.flush_warnings()


class TensorBoardLogger:
    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise LoggerUnavailable(
                "trainer.loggers has 'tensorboard' but the tensorboard package is not "
                f"installed: {extra_install('tensorboard')}, or remove it"
            ) from error
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in clean_metrics(metrics).items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, project: str, name: str, run_dir: str | Path, config: Any = None):
        try:
            import wandb
        except ImportError as error:
            raise LoggerUnavailable(
                f"trainer.loggers has 'wandb' but wandb is not installed: "
                f"{extra_install('wandb')}, or remove it"
            ) from error
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=config)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        scalars = {k: v for k, v in clean_metrics(metrics).items() if v is not None}
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    """Sends each step's metrics to every configured backend (``progress``: where the
    console table prints, default stdout; ``device``: cuda or cpu, what the throughput
    column is per).

    with Tracker(["console", "jsonl"], run_dir) as tracker:
        tracker.log(metrics, step)
    """

    def __init__(
        self,
        loggers: Sequence[str],
        run_dir: str | Path,
        project_name: str = "hybridflow",
        experiment_name: str = "run",
        config: Any = None,
        resume_step: int | None = None,
        progress=None,
        device: str = "cuda",
    ):
        unknown = [name for name in loggers if name not in LOGGER_NAMES]
        if unknown:
            raise ConfigError(
                [f"trainer.loggers has unknown {unknown}; choose from {LOGGER_NAMES}"]
            )
        run_dir = Path(run_dir)
        self.backends: dict[str, Any] = {}
        try:
            for name in loggers:
                if name == "console":
                    self.backends[name] = ConsoleLogger(progress=progress, device=device)
                elif name == "jsonl":
                    self.backends[name] = JsonlLogger(run_dir / "metrics.jsonl", resume_step)
                elif name == "tensorboard":
                    self.backends[name] = TensorBoardLogger(run_dir / "tensorboard")
                else:
                    self.backends[name] = WandbLogger(
                        project_name, experiment_name, run_dir, config
                    )
        except BaseException:
            self.close()
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for backend in self.backends.values():
            backend.log(metrics, step)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends = {}

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
