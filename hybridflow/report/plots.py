"""The report's figures, drawn with matplotlib (object API: no pyplot state, any thread).

Each plot is a function of the runs that returns PNG bytes; every run has one colour in
every plot, and a metric no run logged leaves its panel with a note saying which keys it
looks for (e.g. ``actor/entropy`` is not computed when the on-policy shortcut skips the
old-log-prob pass). Key names: hybridflow/trainer/observe/metrics.py.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridflow.report.runs import Run

RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")
LINE_STYLES = ("-", "--", ":", "-.")
PANEL_SIZE = (4.2, 2.9)  # inches per panel; 100 dpi keeps a PNG around 30 kB
DPI = 100
# Stages in the order the RL loop runs them (trainer/loop/rl_loop.py); others follow.
STAGE_ORDER = ("gen", "gen_baseline", "reward", "old_logprob", "ref", "values", "adv",
               "update_critic", "update_actor", "sync_weights", "validation", "save_checkpoint",
               "wait_checkpoint")  # fmt: skip
# Stages the RL loop times outside timing_s/step (trainer/loop/rl_loop.py: after the step, or
# before it for a rollout from the asynchronous producer)
OUTSIDE_STEP = ("validation", "save_checkpoint", "wait_checkpoint", "wait_rollout")
VALIDATION_KEY = re.compile(r"^val/(?P<source>.+)/(?P<kind>mean|maj|best)@(?P<n>\d+)$")


@dataclass(frozen=True)
class Panel:
    title: str
    lines: tuple[tuple[str, str], ...]
    """(metric key, label) of each line."""
    band: tuple[str, str] | None = None
    """(lower key, upper key): shaded between them, in the run's colour."""
    spread: str | None = None
    """A std key: where a run logged it, the band is the first line's mean ± std instead."""
    ylabel: str = ""


@dataclass(frozen=True)
class Plot:
    slug: str
    title: str
    caption: str
    draw: Callable[[Sequence[Run]], bytes]


def run_color(index: int) -> str:
    return RUN_COLORS[index % len(RUN_COLORS)]


def to_png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def new_figure(panels: int, columns: int = 3):
    from matplotlib.figure import Figure

    columns = max(1, min(columns, panels))
    rows = -(-panels // columns)
    figure = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel().tolist()
    for extra in axes[panels:]:
        extra.set_visible(False)
    return figure, axes[:panels]


def draw_panel(ax, runs: Sequence[Run], panel: Panel) -> None:
    """One panel: a line per (run, key), the band, a legend; a note when nothing was logged."""
    drawn = False
    for index, run in enumerate(runs):
        color = run_color(index)
        band = band_of(run, panel)
        if band is not None:
            ax.fill_between(*band, color=color, alpha=0.15, linewidth=0)
        for style, (key, label) in zip(LINE_STYLES * 4, panel.lines):
            xs, ys = run.series(key)
            if not xs:
                continue
            names = [run.name] * (len(runs) > 1) + [label] * (len(panel.lines) > 1)
            ax.plot(xs, ys, style, color=color, linewidth=1.4, label=" · ".join(names) or None,
                    marker="o" if len(xs) < 12 else None, markersize=3)  # fmt: skip
            drawn = True
    ax.set_title(panel.title, fontsize=10)
    _step_axis(ax)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if drawn and ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7, frameon=False, loc="best")
    if not drawn:
        keys = ", ".join(key for key, _ in panel.lines)
        ax.text(0.5, 0.5, f"not logged:\n{keys}", ha="center", va="center", fontsize=8,
                color="#777777", transform=ax.transAxes, wrap=True)  # fmt: skip


def band_of(run: Run, panel: Panel) -> tuple[list, list, list] | None:
    """(steps, lower, upper) of the panel's shading for ``run``, or None."""
    if panel.spread is not None:
        (xs, mean), (xs_std, std) = run.series(panel.lines[0][0]), run.series(panel.spread)
        if xs and xs == xs_std:
            return xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)]
    if panel.band is not None:
        (xs, low), (xs_high, high) = run.series(panel.band[0]), run.series(panel.band[1])
        if xs and xs == xs_high:
            return xs, low, high
    return None


def _step_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def panels_plot(panels: Sequence[Panel]) -> Callable[[Sequence[Run]], bytes]:
    def draw(runs: Sequence[Run]) -> bytes:
        figure, axes = new_figure(len(panels))
        for ax, panel in zip(axes, panels):
            draw_panel(ax, runs, panel)
        return to_png(figure)

    return draw


def validation_panels(runs: Sequence[Run]) -> list[Panel]:
    """One panel per data source: mean@n, maj@n and best@n."""
    by_source: dict[str, dict[str, str]] = {}
    for key in sorted(set().union(*(run.keys() for run in runs))):
        match = VALIDATION_KEY.match(key)
        if match:
            by_source.setdefault(match["source"], {})[match["kind"]] = key
    panels = []
    for source, kinds in by_source.items():
        lines = tuple(
            (kinds[kind], kinds[kind].rsplit("/", 1)[1])
            for kind in ("mean", "maj", "best")
            if kind in kinds
        )
        panels.append(Panel(f"validation: {source}", lines, ylabel="score"))
    return panels or [Panel("validation", (("val/<source>/mean@<n>", "mean@n"),))]


def draw_validation(runs: Sequence[Run]) -> bytes:
    return panels_plot(validation_panels(runs))(runs)


def stage_keys(runs: Sequence[Run]) -> list[str]:
    """``timing_s/<stage>`` keys of the runs except the whole step, in the loop's order."""
    prefix = "timing_s/"
    stages = {k.removeprefix(prefix) for run in runs for k in run.keys() if k.startswith(prefix)}
    stages.discard("step")
    ordered = [s for s in STAGE_ORDER if s in stages] + sorted(stages - set(STAGE_ORDER))
    return [f"{prefix}{stage}" for stage in ordered]


def wall_seconds(metrics: dict) -> float | None:
    """A step's wall time with what the loop did around it (validation, a save, waits): what
    the stacked stages of the step add up to. None when the step has no timing_s/step."""
    step = metrics.get("timing_s/step")
    if not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    around = (metrics.get(f"timing_s/{stage}") for stage in OUTSIDE_STEP)
    return float(step) + sum(float(v) for v in around if isinstance(v, (int, float)))


def draw_timing(runs: Sequence[Run]) -> bytes:
    """Per run, stacked bars: seconds of each stage per step (validation and checkpoint
    saves on the steps that had them); the wall time the bars add up to as a line."""
    from matplotlib import colormaps

    keys = stage_keys(runs)
    colors = colormaps["tab20"].colors
    figure, axes = new_figure(len(runs), columns=2)
    for ax, run in zip(axes, runs):
        steps = [s for s in run.steps if s > 0]
        bottom = [0.0] * len(steps)
        for index, key in enumerate(keys):
            values = [float(run.steps[s].get(key) or 0.0) for s in steps]
            if any(values):
                ax.bar(steps, values, bottom=bottom, width=1.0, color=colors[index % 20],
                       label=key.removeprefix("timing_s/"), linewidth=0)  # fmt: skip
                bottom = [b + v for b, v in zip(bottom, values)]
        walls = [(s, wall_seconds(run.steps[s])) for s in steps]
        xs, ys = [s for s, w in walls if w is not None], [w for _, w in walls if w is not None]
        if xs:
            ax.plot(xs, ys, color="black", linewidth=0.8, label="wall")
        ax.set_title(f"seconds per step by stage: {run.name}", fontsize=10)
        _step_axis(ax)
        ax.set_ylabel("s", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, axis="y")
        if steps:
            ax.legend(fontsize=6, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        else:
            ax.text(0.5, 0.5, "no step yet", ha="center", va="center", transform=ax.transAxes)
    return to_png(figure)


REWARD_PANELS = (
    Panel("reward", (("reward/mean", "mean"),), ("reward/min", "reward/max"), "reward/std"),
    Panel("score", (("score/mean", "mean"),), ("score/min", "score/max"), "score/std"),
)

PLOTS: tuple[Plot, ...] = (
    Plot("validation", "Validation", "Held-out score per data source: mean@n (average of the "
         "n samples), maj@n (the majority answer), best@n (the best of n).", draw_validation),
    Plot("reward", "Reward", "Sequence reward (after KL or shaping) and score per sample: the "
         "batch mean, shaded ± one standard deviation (min to max for runs that logged no "
         "std).", panels_plot(REWARD_PANELS)),
    Plot("response_length", "Response length", "Tokens per response (mean, max) and the "
         "fraction cut at data.max_response_length.", panels_plot((
             Panel("response length", (("response_length/mean", "mean"),
                                       ("response_length/max", "max")), ylabel="tokens"),
             Panel("clip ratio", (("response_length/clip_ratio", "clipped"),),
                   ylabel="fraction"),
         ))),
    Plot("policy", "Entropy, KL, grad norm, clip fraction", "Policy entropy (per token), KL "
         "(actor/ppo_kl: old to new policy; kl_loss: to the reference), gradient norm before "
         "clipping, fraction of tokens whose ratio was clipped.", panels_plot((
             Panel("entropy", (("actor/entropy", "entropy"),), ylabel="nats"),
             Panel("KL", (("actor/ppo_kl", "ppo_kl"), ("actor/kl_loss", "kl_loss"),
                          ("actor/reward_kl_penalty", "reward KL"))),
             Panel("grad norm", (("actor/grad_norm", "actor"), ("critic/grad_norm", "critic"))),
             Panel("clip fraction", (("actor/pg_clipfrac", "upper"),
                                     ("actor/pg_clipfrac_lower", "lower"),
                                     ("critic/vf_clipfrac", "value")), ylabel="fraction"),
         ))),
    Plot("timing", "Time per stage", "Wall-clock seconds of each stage of a step, stacked "
         "(timing_s/<stage>); the line is the step's wall time with the validation, save and "
         "waits around it.", draw_timing),
    Plot("throughput", "Throughput and memory", "Tokens (prompt + response) per second per "
         "device, MFU (known GPUs only), peak device memory and the controller's resident "
         "memory.", panels_plot((
             Panel("tokens/s per device", (("perf/tokens_per_s_per_gpu", "tokens/s"),)),
             Panel("MFU", (("perf/mfu", "MFU"),), ylabel="fraction of peak"),
             Panel("memory", (("perf/max_memory_allocated_gb", "GPU allocated"),
                              ("perf/max_memory_reserved_gb", "GPU reserved"),
                              ("perf/cpu_memory_used_gb", "CPU resident")), ylabel="GiB"),
         ))),
)  # fmt: skip
