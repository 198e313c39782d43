"""The report page: one HTML file with every figure embedded (base64 PNG), so it can be
mailed or attached as it is, and the same PNGs written beside it."""

from __future__ import annotations

import base64
import datetime
import html
import json
import time
from collections.abc import Sequence
from pathlib import Path

from hybridflow.report.plots import PLOTS, run_color
from hybridflow.report.runs import METRICS_FILE, Run, config_differences

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } .swatch { display: inline-block; width: 12px; height: 12px; }
figure { margin: 12px 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 13px; color: #555; } pre { font-size: 12px; background: #f8f8f8;
padding: 8px; overflow-x: auto; } .note { color: #a15c00; font-size: 13px; }
"""


def last_value(run: Run, key: str) -> str:
    steps, values = run.series(key)
    return f"{values[-1]:.4g} (step {steps[-1]})" if values else "-"


def runs_table(runs: Sequence[Run], now: float) -> str:
    """One row per run: where it is, when it last wrote, a few headline numbers."""
    rows = []
    for index, run in enumerate(runs):
        metrics = run.path / METRICS_FILE
        age = now - metrics.stat().st_mtime
        last_step = max(run.steps) if run.steps else "-"
        val = sorted(k for k in run.keys() if k.startswith("val/") and "/mean@" in k)
        notes = "; ".join(run.notes + ([f"{run.skipped_lines} unreadable line(s) skipped"]
                                       if run.skipped_lines else []))  # fmt: skip
        cells = [
            f'<span class="swatch" style="background:{run_color(index)}"></span> '
            f"{html.escape(run.name)}",
            html.escape(str(run.path)),
            str(last_step),
            f"{_ago(age)} ago",
            "<br>".join(f"{html.escape(k)} = {last_value(run, k)}" for k in val) or "-",
            last_value(run, "reward/mean"),
            last_value(run, "timing_s/step"),
            f'<span class="note">{html.escape(notes)}</span>',
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    header = ["run", "directory", "last step", f"{METRICS_FILE} written", "validation (last)",
              "reward/mean (last)", "step seconds (last)", "notes"]  # fmt: skip
    head = "".join(f"<th>{h}</th>" for h in header)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def config_section(runs: Sequence[Run]) -> str:
    """The keys whose values differ between the runs, then each run's full config."""
    import yaml

    parts = []
    with_config = [run for run in runs if run.config is not None]
    if len(with_config) > 1:
        differences = config_differences([run.config for run in with_config])
        if differences:
            head = "".join(f"<th>{html.escape(run.name)}</th>" for run in with_config)
            rows = "".join(
                f"<tr><td>{html.escape(key)}</td>"
                + "".join(f"<td>{html.escape(_show(v))}</td>" for v in values)
                + "</tr>"
                for key, values in differences.items()
            )
            parts.append(f"<h3>Differences</h3><table><tr><th>key</th>{head}</tr>{rows}</table>")
        else:
            parts.append("<p>The configs are identical.</p>")
    for run in runs:
        if run.config is None:
            parts.append(f"<p class='note'>{html.escape(run.name)}: no config.yaml</p>")
            continue
        text = yaml.safe_dump(run.config, sort_keys=False)
        parts.append(f"<details><summary>{html.escape(run.name)}: full config</summary>"
                     f"<pre>{html.escape(text)}</pre></details>")  # fmt: skip
    return "\n".join(parts)


def write_report(runs: Sequence[Run], out: str | Path) -> list[Path]:
    """Write ``out`` (HTML) and one PNG per plot beside it (``<stem>-<plot>.png``); returns
    every path written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written, figures = [], []
    for plot in PLOTS:
        png = plot.draw(runs)
        path = out.with_name(f"{out.stem}-{plot.slug}.png")
        path.write_bytes(png)
        written.append(path)
        data = base64.b64encode(png).decode("ascii")
        figures.append(
            f'<h2 id="{plot.slug}">{html.escape(plot.title)}</h2><figure>'
            f'<img alt="{html.escape(plot.title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(plot.caption)}</figcaption></figure>"
        )
    now = time.time()
    stamp = datetime.datetime.fromtimestamp(now).strftime("%Y-%m-%d %H:%M")
    title = "hybridflow report: " + ", ".join(run.name for run in runs)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>Written {stamp} by <code>hybridflow report</code>; run it again to update a run that is
still going.</p>
{runs_table(runs, now)}
{"".join(figures)}
<h2 id="config">Config</h2>
{config_section(runs)}
</body></html>
"""
    out.write_text(page, encoding="utf-8")
    return [out, *written]


def _show(value) -> str:
    return "(absent)" if value is None else json.dumps(value, default=str)


def _ago(seconds: float) -> str:
    from hybridflow.progress import format_duration

    return format_duration(seconds)
