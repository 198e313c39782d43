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
import os
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
                   "(default: 0.9 of it; on a CPU, 0.5 of the host memory free at start)")  # fmt: skip
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
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="the largest request body (default: room for the longest prompt the "
                        "context can hold, max_seq_len x 32 characters as JSON, plus 1 MiB)")  # fmt: skip
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="seconds a client has to send a request's headers; an idle "
                        "connection closes after it too (default 10)")  # fmt: skip
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="seconds a client has to send a request's body (default 30)")  # fmt: skip
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


def check_paths(args) -> None:
    """The model, tokenizer and template paths exist and hold what serving needs: said
    before anything loads (UserError, exit 2)."""
    from hybridflow.errors import UserError
    from hybridflow.model_config_values import directory_config_problems
    from hybridflow.models.presets import PRESETS
    from hybridflow.models.tokenizer import CHAR_TOKENIZER_NAMES

    if args.model not in PRESETS:
        _check_directory(args.model, "--model", f"a local Hugging Face model directory or a "
                         f"preset ({', '.join(sorted(PRESETS))})")  # fmt: skip
        problems = directory_config_problems(args.model)  # before the tokenizer reads it
        if problems:
            raise UserError(problems[0])
    tokenizer = args.tokenizer or args.model
    if tokenizer not in CHAR_TOKENIZER_NAMES:
        flag = "--tokenizer" if args.tokenizer else "--model"
        if args.tokenizer:
            _check_directory(tokenizer, flag, "a directory holding the tokenizer files")
        elif args.model in PRESETS:
            raise UserError(f"--model {args.model}: this preset comes without a tokenizer",
                            "pass --tokenizer DIR (a Hugging Face tokenizer directory)")  # fmt: skip
        missing = tokenizer_files_missing(tokenizer)
        if missing:
            raise UserError(f"{flag} {tokenizer}: {missing}",
                            "copy the model's tokenizer files there, or pass --tokenizer DIR")  # fmt: skip
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise UserError(f"--chat-template {args.chat_template}: no such file")


def _check_directory(path: str, flag: str, what: str) -> None:
    from hybridflow.errors import UserError

    if not os.path.exists(path):
        raise UserError(f"{flag} {path}: the path does not exist", f"pass {what}")
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a file, not a directory", f"pass {what}")


def tokenizer_files_missing(directory: str) -> str | None:
    """What the directory lacks to be a tokenizer (None: nothing)."""
    from hybridflow.trainer.lifecycle.preflight import TOKENIZER_FILES

    if any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        return None
    return f"the directory holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})"


def _check_tokenizer(tokenizer, where: str) -> None:
    """A tokenizer that loads but encodes nothing (incomplete files) is refused too."""
    from hybridflow.errors import UserError

    if not tokenizer.encode("hello world", add_special_tokens=False):
        raise UserError(f"the tokenizer of {where} encodes text to no tokens: its files are "
                        "incomplete", "copy the model's tokenizer files there, or pass "
                        "--tokenizer DIR")  # fmt: skip


def limits_from_args(args):
    from hybridflow.errors import UserError
    from hybridflow.serve.limits import ServerLimits

    try:
        return ServerLimits(max_request_bytes=args.max_request_bytes,
                            header_timeout_s=args.header_timeout,
                            body_timeout_s=args.body_timeout)  # fmt: skip
    except ValueError as error:
        names = {"max_request_bytes": "--max-request-bytes", "header_timeout_s":
                 "--header-timeout", "body_timeout_s": "--body-timeout"}  # fmt: skip
        text = str(error)
        for name, flag in names.items():
            text = text.replace(name, flag)
        raise UserError(text) from None


HOST_CACHE_SHARE = 0.5
"""A CPU engine's default cache budget: this share of the host memory free at start (a GPU
engine's is 0.9 of the GPU's free memory, engine/cache/sizing.cache_budget); the rest is
for the decode and prefill workspace, which a CPU engine does not reserve, and the host's
other work."""


def cache_budget_for(memory_budget: float | None, device) -> int | float | None:
    """The engine's memory_budget: --memory-budget as given on a GPU or in bytes; on a CPU,
    unset or a fraction, that share of the host memory free now, in bytes. The engine
    zeroes its whole cache up front, so a --max-batch-size past the host's memory then gets
    the slots that fit instead of taking the host down."""
    if str(device).startswith("cuda") or (memory_budget is not None and memory_budget > 1):
        return memory_budget
    from hybridflow.trainer.plan.host_memory import available_host_bytes

    available, _ = available_host_bytes()
    if available is None:
        return memory_budget
    return int((memory_budget or HOST_CACHE_SHARE) * available)


def allocate_cache(engine, args) -> None:
    """The engine's cache made now, so that one the memory cannot hold stops the server at
    start (exit 2, naming the flags) rather than failing every request."""
    from hybridflow.errors import HOST_OOM, UserError

    try:
        engine.num_slots  # noqa: B018 (allocates the cache)
    except RuntimeError as error:
        if HOST_OOM not in str(error):
            raise
        raise UserError(f"the engine's cache of --max-batch-size {args.max_batch_size} sequences "
                        f"of --max-seq-len {engine.max_seq_len} tokens does not fit the host "
                        "memory", "lower --max-batch-size or --max-seq-len, or give "
                        "--memory-budget in bytes") from None  # fmt: skip


def build_from_args(args):
    """(app, model name, max_seq_len, tokenizer) of a `serve` command line whose paths
    check_paths accepted; UserError, ValueError or OSError for a bad one."""
    import torch

    from hybridflow.bench.common import parse_engine_settings
    from hybridflow.engine import Engine
    from hybridflow.engine.options import EngineOptions
    from hybridflow.models import load_model
    from hybridflow.serve.app import build_app

    limits = limits_from_args(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if str(device).startswith("cuda") else "float32")
    options = EngineOptions.from_dict(parse_engine_settings(args.engine)).checked()
    tokenizer = load_tokenizer_for(args.tokenizer or args.model, args.chat_template)
    _check_tokenizer(tokenizer, args.tokenizer or args.model)
    model = load_model(args.model, dtype=getattr(torch, dtype), device=device)
    model.eval()
    max_seq_len = args.max_seq_len or _default_max_seq_len(model)
    budget = cache_budget_for(args.memory_budget, device)
    engine = Engine(model, max_batch_size=args.max_batch_size, max_seq_len=max_seq_len,
                    memory_budget=budget, options=options)  # fmt: skip
    allocate_cache(engine, args)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    processor = None
    if getattr(engine.config, "vision", None) is not None:  # chat messages may carry images
        from hybridflow.data.images import ImageProcessor

        processor = ImageProcessor.for_model(args.model)
    app = build_app(engine, tokenizer, name, max_records=args.max_records, limits=limits,
                    image_processor=processor)  # fmt: skip
    return app, name, max_seq_len, tokenizer


def run_serve_command(args) -> int:
    import signal

    received = take_stop_signals()
    try:
        return _serve(args)
    except KeyboardInterrupt:
        if received.get("signal") != signal.SIGTERM:
            raise  # Ctrl-C: the command line prints "interrupted" (exit 130)
        print("hybridflow serve: stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM


def _serve(args) -> int:
    import asyncio
    import logging

    from hybridflow.errors import UserError
    from hybridflow.serve.prompts import template_renders_tools
    from hybridflow.serve.running import serve_forever

    logging.basicConfig(level=logging.INFO if args.log_requests else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    try:  # first, before any import of torch: a taken port is said at once
        sock = _bind(args.host, args.port)
    except UserError as error:
        print(f"hybridflow serve: {error}", file=sys.stderr)
        return 2
    with sock:
        try:
            check_paths(args)
            app, name, max_seq_len, tokenizer = build_from_args(args)
        except (UserError, ValueError, OSError) as error:  # a bad path, option or file
            print(f"hybridflow serve: {error}", file=sys.stderr)
            return 2
        if not template_renders_tools(tokenizer):
            print("note: the chat template does not render tools: chat requests with `tools` "
                  "are refused (400); --chat-template FILE gives one that does", file=sys.stderr)  # fmt: skip

        def started(url: str) -> None:
            print(f"serving {name} (max_seq_len {max_seq_len}) at {url}/v1 "
                  "(OpenAI API; Ctrl-C stops)", flush=True)  # fmt: skip

        asyncio.run(serve_forever(app, sock, started))
    return 0


def take_stop_signals() -> dict[str, int]:
    """SIGINT and SIGTERM stop the server, while it loads too: SIGINT also when started where
    it is ignored (``nohup``, ``cmd &`` in a script: the shell starts background jobs with
    SIGINT ignored, and Python keeps an inherited SIG_IGN), SIGTERM (what a service manager
    sends) as a stop with its own last line and exit status 143, not a silent death by the
    signal. Both raise KeyboardInterrupt, which asyncio turns into a clean shutdown; the dict
    returned records which signal came. `hybridflow train` takes both the same way
    (trainer/lifecycle/stop.py)."""
    import signal

    received: dict[str, int] = {}

    def stop(signum, frame) -> None:
        received["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, stop)
    return received


def _bind(host: str, port: int):
    import errno

    from hybridflow.errors import UserError
    from hybridflow.serve.running import bind_socket

    try:
        return bind_socket(host, port)
    except OSError as error:  # the port is taken, the address is not this machine's
        reason = os.strerror(error.errno) if error.errno and error.errno > 0 else str(error)
        if error.errno == errno.EADDRINUSE:
            fix = "pick another --port (0: a free one), or stop the program that holds it"
        else:
            fix = "check --host (127.0.0.1: this machine only; 0.0.0.0: every interface)"
        raise UserError(f"cannot listen on {host}:{port}: {reason}", fix) from None
