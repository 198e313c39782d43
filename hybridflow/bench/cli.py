"""``hybridflow bench``: the engine against HF generate (rollout.py), the time to first token
into a full batch (ttft.py), multi-turn agent episodes against single-turn calls (agent.py),
the actor's update in bf16 against FP8 training matmuls (update.py).

    python -m hybridflow.bench.cli rollout --preset tiny --prompts 8 --new-tokens 16 --device cpu
"""

from __future__ import annotations

import argparse
import sys

from hybridflow.bench.agent import add_agent_arguments, run_agent_command
from hybridflow.bench.rollout import add_rollout_arguments, run_rollout_command
from hybridflow.bench.ttft import add_ttft_arguments, run_ttft_command
from hybridflow.bench.update import add_update_arguments, run_update_command


def add_bench_subcommand(subparsers) -> None:
    """Register `hybridflow bench` and its commands on the CLI's subparsers."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks",
        description="Benchmarks that print a table: the generation engine against HF "
        "transformers, multi-turn agent episodes against single-turn generation.",
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    rollout = bench_sub.add_parser("rollout", help="generation engine vs HF generate")
    add_rollout_arguments(rollout)
    rollout.set_defaults(func=run_rollout_command)
    agent = bench_sub.add_parser("agent", help="multi-turn episodes vs single-turn generate")
    add_agent_arguments(agent)
    agent.set_defaults(func=run_agent_command)
    ttft = bench_sub.add_parser("ttft", help="time to first token into a full batch")
    add_ttft_arguments(ttft)
    ttft.set_defaults(func=run_ttft_command)
    update = bench_sub.add_parser("update", help="the actor's update: bf16 vs FP8 matmuls")
    add_update_arguments(update)
    update.set_defaults(func=run_update_command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.bench.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    rollout = sub.add_parser("rollout", help="generation engine vs HF generate")
    add_rollout_arguments(rollout)
    rollout.set_defaults(func=run_rollout_command)
    ttft = sub.add_parser("ttft", help="time to first token into a full batch")
    add_ttft_arguments(ttft)
    ttft.set_defaults(func=run_ttft_command)
    update = sub.add_parser("update", help="the actor's update: bf16 vs FP8 matmuls")
    add_update_arguments(update)
    update.set_defaults(func=run_update_command)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
