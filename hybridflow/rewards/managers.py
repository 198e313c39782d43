"""Reward managers: decoded responses + ground truths -> one score per response.

    manager = RewardManager("naive", num_workers=4, timeout_s=10)
    scores, metrics = manager.score(responses, ground_truths, data_sources, extra_infos)

Modes (`reward.manager`):
  naive  one scorer call per response, the scorer picked by `data_source` (or custom_fn)
  batch  custom_fn called with lists, split into chunks over the workers
  dapo   naive + DAPO overlong shaping on the response lengths

A custom_fn (user code) runs in reward worker processes, never in the trainer
(rewards/scoring_pool.py). A scorer that raises (sys.exit included), ends its worker
(os._exit, a crash), runs past the timeout or returns something else than a finite number
of at most MAX_ABS_SCORE (None, a string, NaN, 10**400) scores 0 and is counted in
`reward/num_errors` / `reward/num_timeouts` (dead workers also in
`reward/num_worker_deaths`); the first distinct messages are kept in
`RewardResult.error_messages` and what the scoring code printed in `RewardResult.output`
(rewards/monitor.py prints both, capped, and stops a run whose reward always fails). A
scorer may return a float or a dict with a "score" key; the dict's other numeric keys are
averaged into `reward/extra/<key>` and kept per sample in `RewardResult.per_sample`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.rewards.custom import CustomRewardError, split_target
from hybridflow.rewards.parallel import ScoreOutcome
from hybridflow.rewards.scorer_registry import (
    ScorerRegistry,
    ScorerSpec,
    UnknownDataSource,
    default_registry,
)
from hybridflow.rewards.scoring_pool import ScoringPool, ScoringRun

MANAGER_MODES = ("naive", "batch", "dapo")
MAX_ERROR_MESSAGES = 5
MAX_ABS_SCORE = 1e12
"""Larger scores are failures: scores become float32 tensors, where the squares that
advantage normalisation takes overflow to inf (a NaN loss) from about 1.8e19."""


@dataclass
class RewardResult:
    """Scores [B] plus scalar metrics; unpacks as `scores, metrics = result`."""

    scores: list[float]
    metrics: dict[str, float]
    per_sample: dict[str, list[float]] = field(default_factory=dict)
    """Per-response values, e.g. `raw_score` (before shaping), `overlong_penalty`, `acc`."""
    error_messages: list[str] = field(default_factory=list)
    """The first few distinct failure messages, for the log."""
    output: list[tuple[str, str]] = field(default_factory=list)
    """(scorer names, what they printed: at most a capped amount per worker chunk)."""

    def __iter__(self) -> Iterator[Any]:
        yield self.scores
        yield self.metrics


def _as_float(value: Any) -> float | None:
    """A finite float of at most MAX_ABS_SCORE from a Python, numpy or torch number (bools
    count as 0/1), else None."""
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except Exception:  # arrays with more than one element, a user object's item()
            return None
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):  # 10**400: no float holds it
        return None
    return number if math.isfinite(number) and abs(number) <= MAX_ABS_SCORE else None


def normalise_value(value: Any) -> tuple[float, dict[str, float]]:
    """A scorer's return -> (score, numeric extras); raises ValueError for anything else."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score': keys {sorted(map(str, value))}")
        for key, item in value.items():
            number = _as_float(item)
            if key != "score" and number is not None:
                extras[key] = number
        value = value["score"]
    score = _as_float(value)
    if score is None:
        raise ValueError(
            f"returned {_shown(value)}; expected a finite number of at "
            f"most {MAX_ABS_SCORE:g} in size, or a dict with a 'score'"
        )
    return score, extras


def _shown(value: Any, limit: int = 120) -> str:
    """repr() cut to ``limit`` characters; a huge int by its number of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _absolute_target(custom_fn: str) -> str:
    """Resolve a file path once here, so worker processes find the same file."""
    location, function_name = split_target(custom_fn)
    if location.endswith(".py") or "/" in location:
        location = str(Path(location).expanduser().resolve())
    return f"{location}:{function_name}"


class RewardManager:
    """Scores responses; see the module docstring for the modes."""

    def __init__(
        self,
        mode: str = "naive",
        registry: ScorerRegistry | None = None,
        custom_fn: str | None = None,
        num_workers: int = 0,
        timeout_s: float | None = 10.0,
        overlong_buffer_len: int = 0,
        overlong_penalty_factor: float = 1.0,
        max_response_length: int | None = None,
        sandbox_isolation: str = "auto",
    ):
        if mode not in MANAGER_MODES:
            raise ValueError(f"reward.manager={mode!r}; expected one of {MANAGER_MODES}")
        if mode == "batch" and custom_fn is None:
            raise ValueError("reward.manager=batch calls reward.custom_fn with lists; set it")
        if mode == "dapo" and overlong_buffer_len > 0 and max_response_length is None:
            raise ValueError("dapo overlong shaping needs max_response_length")
        self.mode = mode
        self.registry = registry if registry is not None else default_registry(sandbox_isolation)
        self.custom_spec = None
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = overlong_penalty_factor
        self.max_response_length = max_response_length
        self.pool = ScoringPool(num_workers, timeout_s)
        if custom_fn is not None:
            target = _absolute_target(custom_fn)
            # fail now, before training, if the file or name is wrong: in a worker, as the
            # file's import-time code is the user's too
            problem = self.pool.check_loads(target)
            if problem is not None:
                self.pool.close()
                raise CustomRewardError(*problem)
            style = "batch" if mode == "batch" else "custom"
            self.custom_spec = ScorerSpec(target, style=style)

    def known_data_sources(self) -> list[str] | None:
        """Data sources this manager can score; None means any (custom_fn handles all)."""
        return None if self.custom_spec is not None else self.registry.names()

    def check_data_sources(self, data_sources: Sequence[str]) -> None:
        if self.custom_spec is None:
            self.registry.check(data_sources)

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None = None,
        response_lengths: Sequence[int] | None = None,
    ) -> RewardResult:
        """Score each decoded response; `response_lengths` (tokens) is needed by dapo."""
        size = len(responses)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * size
        if not (len(ground_truths) == len(data_sources) == len(extra_infos) == size):
            raise ValueError("responses, ground_truths, data_sources, extra_infos differ in length")
        if self.mode == "batch":
            run = self._score_batched(responses, ground_truths, data_sources, extra_infos)
        else:
            calls = [
                self._call(responses[i], ground_truths[i], data_sources[i], extra_infos[i])
                for i in range(size)
            ]
            run = self._run_known(calls)
        result = self._collect(run.outcomes, data_sources, self._scorer_names(data_sources))
        result.output = run.output
        result.metrics["reward/num_worker_deaths"] = float(run.worker_deaths)
        result.metrics["reward/output_bytes"] = float(run.output_bytes)
        result.metrics["reward/output_bytes_dropped"] = float(run.output_bytes_dropped)
        if self.mode == "dapo" and self.overlong_buffer_len > 0:
            self._apply_overlong_shaping(result, response_lengths)
        return result

    def _call(self, response, ground_truth, data_source, extra_info):
        arguments = {
            "data_source": data_source,
            "solution_str": response,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
        }
        if self.custom_spec is not None:
            return self.custom_spec, arguments
        if data_source not in self.registry:
            # Caught before training by check_data_sources; here it must not stop a run.
            return None, arguments
        return self.registry.get(data_source), arguments

    def _run_known(self, calls) -> ScoringRun:
        """Score calls that have a scorer; the others fail with an 'unknown source' error."""
        known = [i for i, (spec, _) in enumerate(calls) if spec is not None]
        outcomes: list[ScoreOutcome | None] = [None] * len(calls)
        run = self.pool.run([calls[i] for i in known])
        for i, outcome in zip(known, run.outcomes):
            outcomes[i] = outcome
        for i, (spec, arguments) in enumerate(calls):
            if spec is None:
                try:
                    self.registry.get(arguments["data_source"])
                except UnknownDataSource as error:
                    outcomes[i] = ScoreOutcome("error", message=str(error))
        run.outcomes = outcomes
        return run

    def _score_batched(self, responses, ground_truths, data_sources, extra_infos):
        """One list call per chunk; a failed chunk fails all of its samples."""
        workers = max(1, self.pool.num_workers)
        chunk_size = max(1, math.ceil(len(responses) / workers))
        starts = list(range(0, len(responses), chunk_size))
        calls = [
            (
                self.custom_spec,
                {
                    "data_sources": list(data_sources[s : s + chunk_size]),
                    "solution_strs": list(responses[s : s + chunk_size]),
                    "ground_truths": list(ground_truths[s : s + chunk_size]),
                    "extra_infos": list(extra_infos[s : s + chunk_size]),
                },
            )
            for s in starts
        ]
        outcomes: list[ScoreOutcome] = []
        run = self.pool.run(calls)
        for start, chunk_outcome in zip(starts, run.outcomes):
            size = min(chunk_size, len(responses) - start)
            values = chunk_outcome.value
            if chunk_outcome.status == "ok" and (
                not isinstance(values, Sequence) or len(values) != size
            ):
                message = f"batch custom_fn returned {type(values).__name__}, not {size} scores"
                chunk_outcome = ScoreOutcome("error", message=message)
            if chunk_outcome.status == "ok":
                outcomes += [ScoreOutcome("ok", value) for value in values]
            else:
                outcomes += [chunk_outcome] * size
        run.outcomes = outcomes
        return run

    def _scorer_names(self, data_sources: Sequence[str]) -> list[str]:
        """Who scored each sample, for messages: the scorer's target, else the data source."""
        if self.custom_spec is not None:
            return [self.custom_spec.target] * len(data_sources)
        return [self.registry.get(source).target if source in self.registry else source
                for source in data_sources]  # fmt: skip

    def _collect(self, outcomes: list[ScoreOutcome], data_sources: Sequence[str],
                 names: Sequence[str]) -> RewardResult:  # fmt: skip
        scores, messages = [], []
        counts = {"error": 0, "timeout": 0}
        extras: dict[str, list[float]] = defaultdict(list)
        for outcome, name in zip(outcomes, names):
            status, score, sample_extras = outcome.status, 0.0, {}
            if status == "ok":
                try:
                    score, sample_extras = normalise_value(outcome.value)
                except ValueError as error:
                    message = f"scorer {name}: {error}"
                    status, outcome = "error", ScoreOutcome("error", message=message)
            if status != "ok":
                counts[status] += 1
                if len(messages) < MAX_ERROR_MESSAGES and outcome.message not in messages:
                    messages.append(outcome.message)
            scores.append(score)
            for key, value in sample_extras.items():
                extras[key].append(value)
        size = max(1, len(scores))
        metrics = {
            "reward/num_errors": float(counts["error"]),
            "reward/num_timeouts": float(counts["timeout"]),
            "reward/failure_rate": (counts["error"] + counts["timeout"]) / size,
        }
        by_source: dict[str, list[float]] = defaultdict(list)
        for source, score in zip(data_sources, scores):
            by_source[source].append(score)
        for source, values in by_source.items():
            metrics[f"reward/{source}/score_mean"] = sum(values) / len(values)
        for key, values in extras.items():
            metrics[f"reward/extra/{key}"] = sum(values) / len(values)
        per_sample = {"raw_score": list(scores)}
        per_sample.update({k: v for k, v in extras.items() if len(v) == len(scores)})
        return RewardResult(scores, metrics, per_sample, messages)

    def _apply_overlong_shaping(self, result: RewardResult, response_lengths) -> None:
        from hybridflow.algos.dapo import overlong_penalty

        if response_lengths is None or len(response_lengths) != len(result.scores):
            raise ValueError("reward.manager=dapo needs response_lengths for every response")
        penalties = overlong_penalty(
            response_lengths,
            self.max_response_length,
            self.overlong_buffer_len,
            self.overlong_penalty_factor,
        ).tolist()
        result.scores = [score + penalty for score, penalty in zip(result.scores, penalties)]
        result.per_sample["overlong_penalty"] = penalties
        result.metrics["reward/overlong_penalty_mean"] = sum(penalties) / len(penalties)
        result.metrics["reward/overlong_ratio"] = sum(p < 0 for p in penalties) / len(penalties)

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_reward_manager(reward_config: Any, max_response_length: int | None) -> RewardManager:
    """A manager from the `reward` config section (any object with its fields)."""
    return RewardManager(
        mode=reward_config.manager,
        custom_fn=reward_config.custom_fn,
        num_workers=reward_config.num_workers,
        timeout_s=reward_config.timeout_s,
        overlong_buffer_len=reward_config.overlong_buffer_len,
        overlong_penalty_factor=reward_config.overlong_penalty_factor,
        max_response_length=max_response_length,
        sandbox_isolation=reward_config.sandbox_isolation,
    )
