"""`hybridflow` command line: config, train, sft, export, data, bench.

Subcommands import their heavy modules only when they run, so `hybridflow --help` and
`hybridflow config validate` stay instant.
"""

from __future__ import annotations

import argparse
import sys


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="YAML file with config sections")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides such as rollout.n=8 actor.lr=1e-6"
    )


def _load(args):
    from hybridflow.config import load_config

    return load_config(args.config, args.overrides)


def cmd_config(args) -> int:
    from hybridflow.config import ConfigError, validate

    try:
        cfg = _load(args)
        derived = validate(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.action == "show":
        _print_config(cfg, derived)
    else:
        print("config OK")
    return 0


def _print_config(cfg, derived) -> None:
    import dataclasses

    import yaml

    print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False).rstrip())
    print("# derived (computed by validate(); do not set):")
    body = yaml.safe_dump({"derived": dataclasses.asdict(derived)}, sort_keys=False)
    print(
        "\n".join(
            f"{line}  # derived" if line.startswith("  ") else line for line in body.splitlines()
        )
    )


def _run_trainer(kind: str, args) -> int:
    from hybridflow.config import ConfigError

    try:
        cfg = _load(args)
        if kind == "train":
            from hybridflow.trainer.run import train

            train(cfg)
        else:
            from hybridflow.trainer.sft_loop import sft_main

            sft_main(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_export(args) -> int:
    from hybridflow.trainer.export import export_checkpoint

    export_checkpoint(args.checkpoint, args.out)
    print(f"wrote Hugging Face model directory {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("config", help="show or validate a resolved config")
    p.add_argument("action", choices=["show", "validate"])
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("train", help="RL training (no arguments: the built-in GRPO demo)")
    _add_config_args(p)
    p.set_defaults(func=lambda a: _run_trainer("train", a))

    p = sub.add_parser("sft", help="supervised fine-tuning on prompt/response or chat data")
    _add_config_args(p)
    p.set_defaults(func=lambda a: _run_trainer("sft", a))

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.set_defaults(func=cmd_export)

    # Subcommands owned by their packages; each registers itself if importable.
    for module, adder in (
        ("hybridflow.data.cli", "add_data_subcommand"),
        ("hybridflow.engine.bench_cli", "add_bench_subcommand"),
    ):
        try:
            mod = __import__(module, fromlist=[adder])
        except ImportError:
            continue
        getattr(mod, adder)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
