"""``hybridflow report RUN_DIR [RUN_DIR ...] [--out FILE]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_report(args) -> int:
    from hybridflow.report.runs import RunDirError, read_runs

    try:
        runs = read_runs(args.run_dirs)
    except RunDirError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "report.html"
    if out.suffix.lower() not in (".html", ".htm"):
        print(f"error: --out {out}: give a file name ending in .html", file=sys.stderr)
        return 2
    from hybridflow.report.page import write_report  # matplotlib: hybridflow[report]

    paths = write_report(runs, out)
    print(f"wrote {out} ({len(paths) - 1} plots, PNGs beside it as {out.stem}-*.png)")
    return 0


def add_report_subcommand(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="an HTML page of plots of one run or several compared (a run may still be going)",
        description="Plots of metrics.jsonl (validation, reward, lengths, entropy, KL, grad "
        "norm, clip fraction, time per stage, throughput, memory) of each run directory, "
        "overlaid, with each run's config and their differences.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's trainer.run_dir")
    p.add_argument("--out", default=None, help="HTML file (default: RUN_DIR/report.html)")
    p.set_defaults(func=cmd_report)
    return p
