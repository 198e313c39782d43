"""`hybridflow serve`: registered and documented; without aiohttp still listed and saying
what to install; a real run on the tiny preset prints its URL and answers, and stops on
Ctrl-C cleanly; bad paths and a taken port exit 2 with one paragraph, before the model
loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from hybridflow.cli import build_parser, main
from hybridflow.install_hint import extra_install


def _listed(parser) -> set[str]:
    return {a for action in parser._subparsers._group_actions for a in action.choices}


def test_serve_is_registered_and_has_help(capsys):
    assert "serve" in _listed(build_parser())
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--host", "--port", "--tokenizer", "--max-batch-size",
                 "--max-seq-len", "--dtype", "--device"):  # fmt: skip
        assert flag in out


def test_serve_without_aiohttp_stays_listed_and_says_what_to_install(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "hybridflow.serve.cli", raising=False)
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if it were not installed
    parser = build_parser()
    assert "serve" in _listed(parser) and "unavailable" in parser.format_help()
    capsys.readouterr()
    assert main(["serve", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "hybridflow serve" in err and extra_install("serve") in err


def test_bad_model_exits_2_in_one_line(capsys):
    assert main(["serve", "--model", "/no/such/model", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "hybridflow serve:" in err and "Traceback" not in err
    assert "/no/such/model: the path does not exist" in err and "tokenizer" not in err


def test_a_model_directory_without_tokenizer_is_refused_at_startup(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")  # said before the weights are looked at
    assert main(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(tmp_path) in err and "holds no tokenizer" in err and "tokenizer.json" in err
    assert "--tokenizer" in err  # what to do


def test_a_port_in_use_exits_2_with_the_message_and_no_abort():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "hybridflow.cli", "serve", "--model", "tiny", "--device",
             "cpu", "--port", str(port)], capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "--port" in result.stderr  # what to do
    assert "terminate" not in result.stderr and "Traceback" not in result.stderr


def test_serve_runs_the_tiny_preset_and_prints_its_url():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "hybridflow.cli", "serve", "--model", "tiny", "--port",
               "0", "--device", "cpu", "--max-seq-len", "256"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)  # fmt: skip
    try:
        line = process.stdout.readline()
        assert line.startswith("serving tiny"), (line, process.stderr.read())
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 3}).encode()  # fmt: skip
        request = urllib.request.Request(url + "/chat/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] <= 3
        process.send_signal(signal.SIGINT)  # Ctrl-C: the engine's thread stops, no C++ abort
        assert process.wait(timeout=60) == 130
        assert "terminate called" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)


def test_serve_started_with_sigint_ignored_still_stops_on_sigint():
    # a script's `hybridflow serve &` (or nohup) starts it with SIGINT ignored, as train is
    command = [sys.executable, "-m", "hybridflow.cli", "serve", "--model", "tiny", "--port",
               "0", "--device", "cpu", "--max-seq-len", "64"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    try:
        line = process.stdout.readline()
        assert line.startswith("serving tiny"), (line, process.stderr.read())
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_a_cpu_engine_cache_is_sized_from_the_host_memory_free(monkeypatch):
    from hybridflow.serve.cli import cache_budget_for
    from hybridflow.trainer.plan import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (2**30, "test"))
    assert cache_budget_for(None, "cpu") == int(0.5 * 2**30)  # not every --max-batch-size slot
    assert cache_budget_for(0.5, "cpu") == 2**29  # a fraction of the host's free memory
    assert cache_budget_for(3e6, "cpu") == 3e6  # bytes, as given
    assert cache_budget_for(None, "cuda") is None  # the engine reads the GPU's free memory
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (None, ""))
    assert cache_budget_for(None, "cpu") is None  # unknown: as before


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--max-batch-size", str(10**12)], "the engine's cache of --max-batch-size 1000000000000 "
         "sequences of --max-seq-len 2048 tokens does not fit the host memory"),
        (["--max-seq-len", str(10**9)], "one sequence of max_seq_len=1000000000 needs"),
    ],
    ids=["rows", "tokens"],
)  # fmt: skip
def test_a_cpu_cache_past_the_host_memory_stops_serve_at_start(monkeypatch, capsys, flags, words):
    from hybridflow.trainer.plan import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (64 * 2**20, "test"))
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_sigterm_stops_serve_with_a_last_line_and_exit_143(monkeypatch, capsys):
    """A service manager's stop: the server died by the signal, saying nothing. (In this
    process, the server stood in for: a real one stops as it does on Ctrl-C, through
    asyncio's shutdown, test_serve_started_with_sigint_ignored_still_stops_on_sigint.)"""
    from hybridflow.serve import cli as serve_cli

    def serving(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler stops this sleep
        raise AssertionError("SIGTERM did not stop the server")

    monkeypatch.setattr(serve_cli, "_serve", serving)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        assert serve_cli.run_serve_command(None) == 143
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert capsys.readouterr().err == "hybridflow serve: stopped by SIGTERM\n"
