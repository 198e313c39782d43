"""`hybridflow serve`: load a model and serve it with the OpenAI API (app.py).

    hybridflow serve --model /ckpt/qwen2.5-0.5b-instruct --port 8000
    hybridflow serve --model tiny --device cpu          # random weights, char tokenizer

Importing this module is cheap (argparse only); it fails, as the CLI's subcommand mechanism
expects, when aiohttp is not installed, so `hybridflow serve` is listed as unavailable and
says what to install (`pip install 'hybridflow[serve]'`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

if importlib.util.find_spec("aiohttp") is None:  # checked without paying for the import
    raise ModuleNotFoundError("No module named 'aiohttp'", name="aiohttp")

DTYPES = ("bfloat16", "float16", "float32")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="a local Hugging Face model directory or a preset (tiny, ...)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file to use instead of the tokenizer's "
                   "(default: the tokenizer's)")  # fmt: skip
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the --model's last part)")  # fmt: skip
    p.add_argument("--max-batch-size", type=int, default=256,
                   help="sequences the engine decodes at once")  # fmt: skip
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="prompt + completion tokens (default: the model's context, at most 4096)")  # fmt: skip
    p.add_argument("--memory-budget", type=float, default=None,
                   help="KV-cache bytes, or a fraction in (0, 1] of free device memory "
                   "(default: 0.9 of it on a GPU, no limit on a CPU)")  # fmt: skip
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="weights' dtype (default: bfloat16 on cuda, float32 on cpu)")  # fmt: skip
    p.add_argument(
        "--device", default=None, help="device to run on (default: cuda if available, else cpu)"
    )
    p.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                   help="an EngineOptions field, e.g. steps_per_sync=16 (repeatable; default: "
                   "none, EngineOptions' defaults)")  # fmt: skip
    p.add_argument("--max-records", type=int, default=10_000,
                   help="request records kept (token ids and log-probs of each request)")  # fmt: skip
    p.add_argument("--log-requests", action="store_true", help="log every request")


def add_serve_subcommand(subparsers) -> None:
    """Register `serve` on the CLI's subparsers."""
    p = subparsers.add_parser("serve", help="serve a model with the OpenAI API (HTTP)",
                              description=__doc__.splitlines()[0])  # fmt: skip
    add_serve_arguments(p)
    p.set_defaults(func=run_serve_command)


def _default_max_seq_len(model) -> int:
    context = getattr(model.config, "max_position_embeddings", None) or 4096
    window = getattr(model.config, "sliding_window", None)
    return min(context, 4096, window or context)


def load_tokenizer_for(name_or_path: str, chat_template: str | None = None):
    """The tokenizer; the built-in char tokenizer gets the ChatML template with tools."""
    from hybridflow.agents.templates import with_tool_template
    from hybridflow.models.tokenizer import CHAR_TOKENIZER_NAMES, load_tokenizer

    tokenizer = load_tokenizer(name_or_path)
    if name_or_path in CHAR_TOKENIZER_NAMES:
        tokenizer = with_tool_template(tokenizer)
    if chat_template is not None:
        with open(chat_template) as f:
            tokenizer.chat_template = f.read()
    return tokenizer


def build_from_args(args):
    """(app, model name) of a `serve` command line; ValueError / OSError for a bad one."""
    import os

    import torch

    from hybridflow.engine import Engine
    from hybridflow.engine.bench_cli import parse_engine_settings
    from hybridflow.engine.options import EngineOptions
    from hybridflow.models import load_model
    from hybridflow.serve.app import build_app

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if str(device).startswith("cuda") else "float32")
    options = EngineOptions.from_dict(parse_engine_settings(args.engine)).checked()
    tokenizer = load_tokenizer_for(args.tokenizer or args.model, args.chat_template)
    model = load_model(args.model, dtype=getattr(torch, dtype), device=device)
    model.eval()
    max_seq_len = args.max_seq_len or _default_max_seq_len(model)
    engine = Engine(model, max_batch_size=args.max_batch_size, max_seq_len=max_seq_len,
                    memory_budget=args.memory_budget, options=options)  # fmt: skip
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = build_app(engine, tokenizer, name, max_records=args.max_records)
    return app, name, max_seq_len


def run_serve_command(args) -> int:
    import asyncio
    import logging

    from hybridflow.serve.running import serve_forever

    logging.basicConfig(level=logging.INFO if args.log_requests else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    try:
        app, name, max_seq_len = build_from_args(args)
    except (ValueError, OSError) as error:  # a bad path, preset, option or template file
        print(f"hybridflow serve: {error}", file=sys.stderr)
        return 2

    def started(url: str) -> None:
        print(f"serving {name} (max_seq_len {max_seq_len}) at {url}/v1 "
              "(OpenAI API; Ctrl-C stops)", flush=True)  # fmt: skip

    try:
        asyncio.run(serve_forever(app, args.host, args.port, started))
    except OSError as error:  # the port is taken, the host cannot be bound
        print(f"hybridflow serve: cannot listen on {args.host}:{args.port}: {error}",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0
