"""`hybridflow` command line: config, train, sft, export, data, bench, serve, report.

Subcommands import their heavy modules only when they run, so `hybridflow --help`,
`hybridflow config show` and the memory plan of `config plan` start in a fraction of a second:
torch loads only where a command needs it (to ask whether a GPU is visible for
trainer.device=auto, to build a model on the meta device for a layout's resharding plan, to
tokenize and batch the data `config validate` checks); tests/test_cli.py keeps it so. Every subcommand is always listed: one whose
module cannot be imported (a missing optional package, a broken install) says so in one line
when it runs, with what to install, and exits with status 2.

Errors: a problem with the input or the environment prints one paragraph naming the file,
key, row or line and the fix, and exits with status 2; anything else is a bug and shows its
traceback (hybridflow/errors.py). ``--debug`` shows the traceback of every error.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hybridflow.errors import UserError, report
from hybridflow.install_hint import extra_install

# Import name -> what `pip install` takes, where the two differ.
PIP_NAMES = {"yaml": "pyyaml"}
# Import name -> the extra of hybridflow that brings it (pyproject.toml).
EXTRAS = {
    "ray": "ray",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "aiohttp": "serve",
    "matplotlib": "report",
}

# Subcommands whose parsers their own modules add: (name, module, adder, help).
PACKAGE_SUBCOMMANDS = (
    ("data", "hybridflow.data.cli", "add_data_subcommand", "prepare and check prompt data files"),
    ("bench", "hybridflow.bench.cli", "add_bench_subcommand", "benchmarks"),
    ("serve", "hybridflow.serve.cli", "add_serve_subcommand", "serve a model with the OpenAI API"),
    ("report", "hybridflow.report.cli", "add_report_subcommand", "plots of runs as one HTML page"),
)


class SubcommandUnavailable(UserError):
    """A subcommand's module could not be imported; ``str()`` is the line users see."""


def unavailable_reason(command: str, module: str, error: ImportError) -> str:
    """One line: which import failed, why, and what to install."""
    missing = (error.name or "").split(".")[0]
    what = f"`hybridflow {command}` is unavailable: importing {module} failed ({error})"
    if not missing or missing == "hybridflow":
        return f"{what}; the hybridflow install is incomplete: reinstall it (pip install -e .)"
    package = PIP_NAMES.get(missing, missing)
    if isinstance(error, ModuleNotFoundError):
        if missing in EXTRAS:
            return f"{what}; install the missing package: {extra_install(EXTRAS[missing])}"
        return f"{what}; install the missing package: pip install {package}"
    return f"{what}; reinstall the package it names: pip install --force-reinstall {package}"


def import_for(command: str, module: str):
    """``module``, imported for ``command``; :class:`SubcommandUnavailable` when it fails."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise SubcommandUnavailable(unavailable_reason(command, module, error)) from None


def _add_debug_flag(p: argparse.ArgumentParser) -> None:
    """``--debug`` after the subcommand too (SUPPRESS: absent, it keeps the top-level value)."""
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the traceback of every error")  # fmt: skip


KEYS_DOCUMENTED = (
    "Config keys: every section and key, with what it does and its default, is documented "
    "in hybridflow/config/sections.py (the docstring under each field); `hybridflow config "
    "show [--config FILE] [KEY=VALUE ...]` prints the values a command line resolves to. "
    "verl's keys are accepted too and translated (docs/migrating-from-verl.md)."
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default appended to its help, unless the
    help says it already (``(default: the model's)``) or there is none to say (a flag that
    is off, an option that is unset)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == []
        if "default" in text.lower() or unset or action.default == argparse.SUPPRESS:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


def walk_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("hybridflow",)):
    """(command words, parser) for ``parser`` and every subcommand's parser below it."""
    yield path, parser
    for action in parser._actions:  # argparse keeps no public list of its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk_parsers(child, (*path, name))


RL_EXAMPLES = ("examples/grpo.yaml", "rollout.n=8 actor.lr=1e-6")
SFT_EXAMPLES = ("sft.yaml (its `model`, `sft` and `trainer` sections)",
                "model.path=/models/Qwen2.5-0.5B-Instruct sft.train_files=[data/sft.jsonl] "
                "sft.lr=1e-5 sft.total_steps=500")  # fmt: skip
"""What ``--help`` shows as a --config file and as overrides: RL's for train and config, SFT's
for sft (an RL example there sets keys SFT never reads)."""


def _add_config_args(p: argparse.ArgumentParser, examples: tuple[str, str] = RL_EXAMPLES) -> None:
    config_file, overrides = examples
    _add_debug_flag(p)
    p.add_argument("--config", "-c", default=None,
                   help=f"YAML file with config sections, e.g. {config_file} (default: "
                   "none, every key at its default)")  # fmt: skip
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help=f"dotted overrides over the --config file, such as {overrides} "
        "(verl's keys too); default: none",
    )  # fmt: skip


def _load(args):
    from hybridflow.config.verl import load_with_verl_keys

    return load_with_verl_keys(args.config, args.overrides)  # verl's keys too, translated


def cmd_config(args) -> int:
    from hybridflow.config import validate

    cfg = _load(args)
    if args.action == "plan":  # GPU memory, item by item, before any model loads
        plan_command = import_for("config", "hybridflow.trainer.plan.plan_command")
        progress = _stderr_progress()  # the search for a layout: seconds at 96 GPUs
        try:
            return plan_command.plan_command(cfg, args.gpu_memory, progress=progress)
        finally:
            progress.close()
    if args.action == "validate":  # everything `train` checks before it loads a model
        if args.gpu_memory is not None:  # the memory plan checked against this GPU size
            plan_command = import_for("config", "hybridflow.trainer.plan.plan_command")
            cfg.trainer.gpu_memory_gib = plan_command.parse_size(args.gpu_memory) / 2**30
        notes = import_for("config", "hybridflow.trainer.lifecycle.preflight").check_run(cfg)
        print("config OK" + "".join(f" ({note})" for note in notes))
        return 0
    _print_config(cfg, validate(cfg))  # show
    return 0


def _stderr_progress():
    """A progress reporter on stderr: a transient bar on a terminal, else a status line after
    10 s of silence; stdout keeps the command's own output."""
    from rich.console import Console

    from hybridflow.progress import ProgressReporter

    return ProgressReporter(Console(stderr=True))


def cmd_config_from_verl(args) -> int:
    from hybridflow.config import ConfigError
    from hybridflow.config.verl import from_verl_yaml

    try:
        print(from_verl_yaml(args.config, args.overrides), end="")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _config_action(args) -> int:
    return cmd_config_from_verl(args) if args.action == "from-verl" else cmd_config(args)


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
    cfg = _load(args)
    if kind == "train":
        import_for("train", "hybridflow.trainer.lifecycle.run").train(cfg)
    else:
        import_for("sft", "hybridflow.trainer.loop.sft_loop").sft_main(cfg, _given_keys(args))
    return 0


def _given_keys(args) -> list[str]:
    """The keys the command line's overrides set (verl's translated to ours)."""
    from hybridflow.config.verl import translate_command_line

    overrides = translate_command_line(args.config, args.overrides).overrides
    return [item.split("=", 1)[0].strip() for item in overrides]


def cmd_export(args) -> int:
    import shutil
    from pathlib import Path

    from hybridflow.trainer.lifecycle.stop import StopRequest

    export = import_for("export", "hybridflow.trainer.lifecycle.export")
    out = Path(args.out)
    existed = out.exists()
    export.check_export_target(out, overwrite=args.overwrite)  # makes a new one
    try:  # nothing to save on the way: SIGTERM or Ctrl-C stops the export at once
        with StopRequest().on_signals(lambda line: print(line, file=sys.stderr)):
            export.export_checkpoint(args.checkpoint, args.out)
    except BaseException as error:
        stopped = isinstance(error, (KeyboardInterrupt, SystemExit))
        if not existed and out.exists():  # a half-written model must not pass for one
            shutil.rmtree(out, ignore_errors=True)
            if stopped:
                print(f"removed the partial export {out}", file=sys.stderr)
        elif stopped and out.is_dir():
            print(f"{out} may hold a partial export: export again before using it",
                  file=sys.stderr)  # fmt: skip
        raise
    print(f"wrote Hugging Face model directory {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of every error (also user errors)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_config_subcommand(sub)
    for kind, help_text, what in (
        ("train", "RL training (no arguments: the built-in GRPO demo)",
         "RL training (PPO, GRPO, ...) of the config the --config file and the KEY=VALUE "
         "overrides make; with neither, the built-in GRPO demo on the arithmetic task."),
        ("sft", "supervised fine-tuning on prompt/response or chat data",
         "Supervised fine-tuning of model.path on the prompt/response or chat rows of "
         "sft.train_files (the `sft` section's keys set the run; an RL key it never reads, "
         "such as trainer.total_steps, is refused naming the sft key to set), e.g. `hybridflow sft "
         "model.path=/models/Qwen2.5-0.5B-Instruct sft.train_files=[data/sft.jsonl] "
         "sft.total_steps=500`."),
    ):  # fmt: skip
        p = sub.add_parser(kind, help=help_text, description=what, epilog=KEYS_DOCUMENTED)
        _add_config_args(p, SFT_EXAMPLES if kind == "sft" else RL_EXAMPLES)
        p.set_defaults(func=lambda a, kind=kind: _run_trainer(kind, a))

    p = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory",
        description="Write the model of a training checkpoint as a Hugging Face model "
        "directory (config.json, safetensors weights, tokenizer files) that transformers, "
        "vLLM and `hybridflow serve` load.",
    )
    p.add_argument("checkpoint",
                   help="a checkpoint directory, e.g. RUN_DIR/checkpoints/step_100")  # fmt: skip
    p.add_argument("out", help="the model directory to write (created; an existing one must "
                   "be empty unless --overwrite)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="write into OUT even when it holds files (its model files are "
                   "replaced, other files are left)")  # fmt: skip
    _add_debug_flag(p)
    p.set_defaults(func=cmd_export)

    # Subcommands owned by their packages: each adds its own parser when its module imports,
    # and is listed all the same when it does not (running it then says why).
    for name, module, adder, help_text in PACKAGE_SUBCOMMANDS:
        try:
            getattr(import_for(name, module), adder)(sub)
        except SubcommandUnavailable as unavailable:
            _add_unavailable(sub, name, help_text, str(unavailable))
    for _, each in walk_parsers(parser):
        each.formatter_class = HelpFormatter  # one look for every --help, defaults shown
        _describe_subcommands(each)
    return parser


def _describe_subcommands(parser: argparse.ArgumentParser) -> None:
    """A subcommand's ``--help`` says what it does: its one-line help where it has no
    description of its own."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:  # one per subcommand: its name and help
                child = action.choices[choice.dest]
                if not child.description and choice.help:
                    child.description = choice.help[0].upper() + choice.help[1:] + "."


CONFIG_ACTIONS = (
    ("show", "print the resolved config as YAML",
     "Print the config a command line resolves to (defaults < the --config file < the "
     "KEY=VALUE overrides, verl's keys translated) as YAML, then the sizes validate() derives "
     "from it, marked `# derived`."),
    ("validate", "check a config as `train` does, before any model loads",
     "Check everything `hybridflow train` checks before it loads a model: every key and "
     "value, the GPU memory plan, the host memory a step's data needs, the devices and the "
     "run directory, the model directory (config.json and its architecture, the weights' "
     "names and shapes, the tokenizer, without loading the weights), the reward function and "
     "the data files. Prints `config OK`; else each problem with its fix, exit status 2."),
    ("plan", "the memory plan of a config, item by item",
     "The memory plan of a config, before any model loads: the GPU bytes of weights, "
     "gradients, optimizer state, activations and KV cache of each role, checked against one "
     "GPU's memory; then the host memory a step's data (and a CPU run's model) needs, "
     "checked against the memory free on this machine."),
    ("from-verl", "a verl command line as one hybridflow YAML config",
     "Write a verl command line (verl's keys, with our keys and an optional --config file "
     "of ours) as one hybridflow YAML config, each translated key commented with the verl "
     "key it came from. Nothing runs."),
)  # fmt: skip


def _add_config_subcommand(sub) -> None:
    config = sub.add_parser(
        "config",
        help="show, validate or plan the memory of a config; from-verl: a verl command "
        "line as YAML",
        description="Look at a config without running it.",
        epilog=KEYS_DOCUMENTED,
    )
    actions = config.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, help_text, description in CONFIG_ACTIONS:
        p = actions.add_parser(action, help=help_text, description=description,
                               epilog=KEYS_DOCUMENTED)  # fmt: skip
        if action in ("plan", "validate"):
            p.add_argument("--gpu-memory", default=None,
                           help="memory of one GPU, e.g. 80GiB (default: "
                           "trainer.gpu_memory_gib, else the visible GPU's, else no fit "
                           "check)")  # fmt: skip
        _add_config_args(p)
        p.set_defaults(func=_config_action)


def _add_unavailable(sub, name: str, help_text: str, reason: str) -> None:
    """A stand-in parser that takes any arguments and, when run, reports ``reason``."""
    p = sub.add_parser(name, help=f"{help_text} (unavailable here: run it to see why)",
                       add_help=False)  # fmt: skip

    def say_unavailable(args) -> int:
        raise SubcommandUnavailable(reason)

    p.set_defaults(func=say_unavailable, takes_any_arguments=True)


def command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The innermost (sub)command parser ``args`` were parsed by: ``bench rollout``'s for
    ``hybridflow bench rollout ...``, the top-level one when no command was given."""
    while True:
        chosen = None
        for action in parser._actions:  # argparse keeps no public list of its subparsers
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(args, action.dest, None) or "")
        if chosen is None:
            return parser
        parser = chosen


def quiet_import_warnings() -> None:
    """transformers imports torchao (the fp8 extra) whenever it is installed, in every run;
    on a torch it was not built for, torchao's import logs that its C++ kernels did not load
    (the float8 training path is Python) and torch's pytree logs a deprecation for its enums.
    Neither says anything about this run, and they would bury its first lines."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    quiet_import_warnings()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and isinstance(getattr(args, "overrides", None), list):
        # `config validate --config x.yaml a=b`: argparse fills the positionals before the
        # option and leaves the overrides after it over; they are overrides all the same
        args.overrides += [item for item in unknown if "=" in item and not item.startswith("-")]
        unknown = [item for item in unknown if "=" not in item or item.startswith("-")]
    if unknown and not getattr(args, "takes_any_arguments", False):
        # said by the subcommand's own parser: its usage line shows the options it does take
        command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as error:  # a package the command imports as it goes
        missing = UserError(unavailable_reason(args.command, error.name, error))
        missing.__cause__, missing.__traceback__ = error, error.__traceback__
        text, status = report(missing, debug=args.debug)
    except Exception as error:  # the one error boundary (hybridflow/errors.py)
        text, status = report(error, debug=args.debug)
    print(text, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
