"""`hybridflow data ...`: prepare and check prompt files.

hybridflow data gsm8k --input /path/to/train.jsonl --out data/gsm8k
hybridflow data gsm8k --from-hub --out data/gsm8k
hybridflow data geo3k --input /path/to/geometry3k/train-00000-of-00001.parquet --out data/geo3k
hybridflow data arithmetic --out data/arithmetic
hybridflow data countdown --out data/countdown
hybridflow data check data/gsm8k/train.parquet
hybridflow data check builtin:arithmetic
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter


def _cmd_gsm8k(args) -> int:
    from hybridflow.data.gsm8k import convert_gsm8k_file, convert_gsm8k_from_hub, describe
    from hybridflow.progress import ProgressReporter

    if args.from_hub == bool(args.input):
        print("error: give exactly one of --input FILE and --from-hub", file=sys.stderr)
        return 2
    progress = ProgressReporter()
    source = "the Hub's openai/gsm8k" if args.from_hub else args.input
    with progress.task(f"gsm8k: converting {source}"):
        if args.from_hub:
            paths = convert_gsm8k_from_hub(args.out)
        else:
            paths = [convert_gsm8k_file(args.input, args.out, split=args.split)]
    progress.close()
    for path in paths:
        print(f"wrote {describe(path)}")
    return 0


def _cmd_geo3k(args) -> int:
    from hybridflow.data.geo3k import convert_geo3k_file
    from hybridflow.progress import ProgressReporter

    progress = ProgressReporter()
    with progress.task(f"geo3k: converting {args.input} (each image decoded once)"):
        done = convert_geo3k_file(args.input, args.out, split=args.split)
    progress.close()
    print(f"wrote {done.path}: {done.rows} rows, {done.images} images; first ground truth "
          f"{done.first_ground_truth!r}")  # fmt: skip
    return 0


def _cmd_arithmetic(args) -> int:
    from hybridflow.data.arithmetic import write_arithmetic_dataset

    paths = write_arithmetic_dataset(
        args.out,
        train_size=args.train_size,
        test_size=args.test_size,
        sft_size=args.sft_size,
        seed=args.seed,
        operations=tuple(args.operations),
        max_operand=args.max_operand,
        file_format=args.format,
    )
    for name, path in paths.items():
        print(f"wrote {name}: {path}")
    return 0


def _cmd_countdown(args) -> int:
    from hybridflow.data.countdown import write_countdown_dataset

    paths = write_countdown_dataset(
        args.out,
        train_size=args.train_size,
        test_size=args.test_size,
        seed=args.seed,
        num_numbers=args.num_numbers,
        max_number=args.max_number,
        file_format=args.format,
    )
    for name, path in paths.items():
        print(f"wrote {name}: {path}")
    return 0


def _cmd_check(args) -> int:
    from hybridflow.data.builtin import BUILTIN_PREFIX, iter_records
    from hybridflow.data.schema import iter_prompt_records

    known = None
    if args.known_sources:
        from hybridflow.rewards.scorer_registry import default_registry

        known = default_registry().names()
    for path in args.files:
        # counted as they are read: memory holds one row (or parquet batch), not the file
        if path.startswith(BUILTIN_PREFIX):  # as data.train_files takes it: both splits
            for split, name in (("train", "training"), ("test", "validation")):
                counts = Counter(r.data_source for r in iter_records(path, split, known))
                print(f"{path} ({name} split, the default sizes): {sum(counts.values())} rows "
                      f"OK; data sources {dict(counts)}")  # fmt: skip
            continue
        if args.image_key:
            print(_check_images(path, args.image_key, known, args.prompt_key))
            continue
        records = iter_prompt_records(path, known_data_sources=known, prompt_key=args.prompt_key)
        counts = Counter(record.data_source for record in records)
        print(f"{path}: {sum(counts.values())} rows OK; data sources {dict(counts)}")
    return 0


def _check_images(path: str, image_key: str, known, prompt_key: str) -> str:
    """The line data check prints for a file read with its images (each one decoded)."""
    from hybridflow.data.schema import iter_prompt_records

    counts, images = Counter(), 0
    for record in iter_prompt_records(path, known, prompt_key, image_key):
        counts[record.data_source] += 1
        images += len(record.images)
    return (f"{path}: {sum(counts.values())} rows OK, {images} images decoded; data sources "
            f"{dict(counts)}")  # fmt: skip


def out_dir_problem(out: str) -> str | None:
    """Make the ``--out`` directory; why it cannot be made (it, or a folder above it, is a
    file; the file system refuses), or None when it is there."""
    from pathlib import Path

    path = Path(out).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        return (f"--out {out}: {existing} is a file, not a directory: give a directory to "
                "write the files to")  # fmt: skip
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return (f"--out {out}: the directory cannot be made ({error.strerror or error}): give "
                "a directory you can write to")  # fmt: skip
    return None


def _run(handler):
    """Turn data errors into one readable line and exit code 2 instead of a traceback."""

    def run(args) -> int:
        from hybridflow.data.schema import DataSchemaError

        problem = out_dir_problem(args.out) if getattr(args, "out", None) else None
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        try:
            return handler(args)
        except (DataSchemaError, RuntimeError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    return run


def add_data_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register `data` and its actions on the top-level `hybridflow` subparsers."""
    parser = subparsers.add_parser(
        "data",
        help="prepare and check prompt data files",
        description="Write the built-in tasks and GSM8K as prompt files in verl's schema "
        "(parquet or jsonl), and check prompt files before a run reads them.",
    )
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    p = actions.add_parser(
        "gsm8k",
        help="convert original GSM8K (jsonl/parquet) to verl schema",
        description="Convert GSM8K's original rows (question, answer) into verl's prompt "
        "schema, with the final answer as the ground truth.",
    )
    p.add_argument("--input", help="original gsm8k file with 'question' and 'answer' "
                   "(default: none; give it or --from-hub)")  # fmt: skip
    p.add_argument("--from-hub", action="store_true", help="download with `datasets` instead")
    p.add_argument("--out", required=True, help="output directory (<split>.parquet)")
    p.add_argument("--split", default=None, help="split name (default: input file stem)")
    p.set_defaults(func=_run(_cmd_gsm8k))

    p = actions.add_parser(
        "geo3k",
        help="convert Geometry3K (the Hub's parquet, with images) to verl schema",
        description="Convert Geometry3K rows (problem, answer, images: the Hub's "
        "hiyouga/geometry3k parquet, or rows verl's geo3k preprocessing wrote) into verl's "
        "prompt schema with the images embedded and verl's <think>/\\boxed{} instruction; "
        "each image is decoded once and a row without a usable one is refused.",
    )
    p.add_argument("--input", required=True,
                   help="a geometry3k parquet or jsonl file (e.g. the Hub's "
                   "data/train-00000-of-00001.parquet)")  # fmt: skip
    p.add_argument("--out", required=True, help="output directory (<split>.parquet)")
    p.add_argument("--split", default=None,
                   help="split name (default: the input's name: train-00000-of-00001 -> train)")  # fmt: skip
    p.set_defaults(func=_run(_cmd_geo3k))

    p = actions.add_parser(
        "arithmetic",
        help="write the built-in arithmetic task",
        description="Write the built-in arithmetic task (`builtin:arithmetic`): train.* and "
        "test.* prompt files and sft.* prompt/response pairs for a warm start.",
    )
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--train-size", type=int, default=4000, help="problems in train.*")
    p.add_argument("--test-size", type=int, default=200, help="problems in test.*")
    p.add_argument("--sft-size", type=int, default=4000,
                   help="solved problems in sft.*, none of them in test.*")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random problems")
    p.add_argument("--operations", nargs="+", default=["+"], choices=["+", "-", "*"],
                   help="the operations problems use")  # fmt: skip
    p.add_argument("--max-operand", type=int, default=99, help="largest operand")
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet",
                   help="file format")  # fmt: skip
    p.set_defaults(func=_run(_cmd_arithmetic))

    p = actions.add_parser(
        "countdown",
        help="write the built-in countdown task",
        description="Write the built-in countdown task (`builtin:countdown`: reach a target "
        "from given numbers with + - * /): train.*, test.* and sft.* files.",
    )
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--train-size", type=int, default=4000, help="problems in train.*")
    p.add_argument("--test-size", type=int, default=200, help="problems in test.*")
    p.add_argument("--seed", type=int, default=0, help="seed of the random problems")
    p.add_argument("--num-numbers", type=int, default=3, help="numbers given per problem")
    p.add_argument("--max-number", type=int, default=20, help="largest number given")
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet",
                   help="file format")  # fmt: skip
    p.set_defaults(func=_run(_cmd_countdown))

    p = actions.add_parser(
        "check",
        help="validate prompt files and count rows per data source",
        description="Read prompt files as a run would (schema, prompt column, data sources) "
        "and print the rows per data source; each problem names the file and row.",
    )
    p.add_argument("files", nargs="+",
                   help="prompt files (.parquet, .jsonl, .json) or built-in tasks "
                   "(builtin:arithmetic, builtin:countdown, builtin:calc)")  # fmt: skip
    p.add_argument("--prompt-key", default="prompt",
                   help="the column holding the prompt (data.prompt_key)")  # fmt: skip
    p.add_argument("--image-key", default=None,
                   help="also decode the images of this column and count each prompt's "
                   "<image> placeholders (data.image_key, verl's: images); default: "
                   "none, images are not checked")  # fmt: skip
    p.add_argument(
        "--known-sources",
        action="store_true",
        help="also fail on data sources no built-in scorer handles",
    )
    p.set_defaults(func=_run(_cmd_check))
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m hybridflow.data.cli ...`, the same as `hybridflow data ...`."""
    parser = argparse.ArgumentParser(prog="hybridflow")
    add_data_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
