"""The generative judge: the template's slots, the score parser, failures counted as for
rule rewards, the OpenAI-compatible engine's timeouts, and a judge that always fails stops
the run."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridflow.errors import UserError
from hybridflow.rewards.judge import JudgeReward, fill_template, parse_score
from hybridflow.rewards.judge_engines import url_asker
from hybridflow.rewards.monitor import FIX_JUDGE, RewardFailureMonitor
from hybridflow.rewards.parallel import ScoreOutcome

TEMPLATE = 'Rate {"json": "kept"}\nQ: {prompt}\nA: {response}\nKey: {ground_truth}\nScore:'
PATTERN = r"Score:\s*(-?\d+(?:\.\d+)?)"


def test_slots_are_filled_and_other_braces_kept():
    text = fill_template(TEMPLATE, [{"role": "user", "content": "2+2?"}], "4", 4)
    assert text == 'Rate {"json": "kept"}\nQ: user: 2+2?\nA: 4\nKey: 4\nScore:'


def test_the_last_match_is_the_score():
    import re

    assert parse_score("Score: 3 ... final Score: 7.5", re.compile(PATTERN)) == 7.5
    assert parse_score("I give it 8/10", re.compile(r"-?\d+")) == 10.0  # no group: the match
    with pytest.raises(ValueError, match="no score"):
        parse_score("great answer", re.compile(PATTERN))


def test_failures_score_zero_and_are_counted():
    replies = [ScoreOutcome("ok", "Score: 9"), ScoreOutcome("ok", "no idea"),
               ScoreOutcome("timeout", message="judge took more than 1s"),
               ScoreOutcome("error", message="judge: connection refused")]  # fmt: skip
    asked = []

    def ask(prompts):
        asked.extend(prompts)
        return replies

    judge = JudgeReward(TEMPLATE, PATTERN, ask)
    result = judge.score(["p"] * 4, ["a", "b", "c", "d"], [None] * 4)
    assert result.scores == [9.0, 0.0, 0.0, 0.0]
    assert result.metrics["reward/judge/num_errors"] == 2.0
    assert result.metrics["reward/judge/num_timeouts"] == 1.0
    assert result.metrics["reward/judge/failure_rate"] == 0.75
    assert "A: b" in asked[1] and len(result.error_messages) == 3


def test_a_judge_that_always_fails_stops_the_run_after_patience_steps():
    judge = JudgeReward(TEMPLATE, PATTERN, lambda prompts: 1 / 0)  # the engine raises
    lines = []
    monitor = RewardFailureMonitor(lines.append, patience=2, metric_prefix="reward/judge",
                                   what="judge", fix=FIX_JUDGE)  # fmt: skip
    monitor.observe(judge.score(["p"], ["a"], [None]), step=1)
    assert lines[0] == "judge error (shown once): judge engine: ZeroDivisionError: division by zero"
    with pytest.raises(UserError, match="the judge failed on every sample for 2 steps"):
        monitor.observe(judge.score(["p"], ["a"], [None]), step=2)
    assert sum("shown once" in line for line in lines) == 1  # reported once


def test_a_score_that_parses_to_inf_or_nan_is_a_counted_failure():
    replies = [ScoreOutcome("ok", "Score: " + "9" * 5000), ScoreOutcome("ok", "Score: nan"),
               ScoreOutcome("ok", "Score: 2")]  # fmt: skip
    judge = JudgeReward(TEMPLATE, r"Score:\s*(\S+)", lambda prompts: replies)
    result = judge.score(["p"] * 3, ["a", "b", "c"], [None] * 3)
    assert result.scores == [0.0, 0.0, 2.0]
    assert result.metrics["reward/judge/num_errors"] == 2.0
    assert result.error_messages[0].startswith(
        "judge score '9999999999999999999999999999999999999999... (5000 characters)' is not "
        "a finite number of at most 1e+12 in size"
    )


class _Judge(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        if "slow" in prompt:
            time.sleep(2)
        reply = {"choices": [{"message": {"content": f"Score: {len(prompt) % 7}"}}]}
        if "object" in prompt:  # malformed: the content is not text
            reply = {"choices": [{"message": {"content": {"score": 9}}}]}
        if "huge" in prompt:  # 8 MB, in chunks as an endless reply comes
            self._send_chunked(json.dumps({**reply, "padding": "x" * 8_000_000}).encode())
            return
        data = json.dumps(reply).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except BrokenPipeError:  # the client timed out and closed the connection
            pass

    def _send_chunked(self, data: bytes) -> None:
        self.protocol_version = "HTTP/1.1"
        try:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for start in range(0, len(data), 1 << 16):
                chunk = data[start : start + (1 << 16)]
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading
            pass

    def log_message(self, *args):
        pass


def test_a_second_model_behind_an_openai_server_and_its_timeouts():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        ask = url_asker(url, "judge", max_tokens=8, timeout_s=0.5, concurrency=4)
        outcomes = ask(["ok", "slow please"])
        assert outcomes[0] == ScoreOutcome("ok", "Score: 2")
        assert outcomes[1].status == "timeout" and "0.5s" in outcomes[1].message
        refused = url_asker("http://127.0.0.1:9/v1", "judge", 8, 0.5, 1)(["x"])[0]
        assert refused.status == "error"
        malformed = url_asker(url, "judge", 8, timeout_s=10, concurrency=1)(["object"])[0]
        assert malformed == ScoreOutcome("error", message=f"judge {url}/chat/completions: "
                                         "TypeError: the reply's message content is a dict, "
                                         "not text")  # fmt: skip
        huge = url_asker(url, "judge", max_tokens=8, timeout_s=10, concurrency=1)(["huge"])[0]
        assert huge == ScoreOutcome("error", message=f"judge {url}/chat/completions: "
                                    "ReplyTooLarge: reply larger than 1048576 bytes")  # fmt: skip
    finally:
        server.shutdown()


def test_a_connection_the_server_drops_is_tried_again_within_the_deadline():
    """A judge server under a burst resets some connections from its backlog: those samples
    are asked again, not scored as failures; a server that never answers is still an error."""
    import socket
    import struct

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    reply = json.dumps({"choices": [{"message": {"content": "Score: 4"}}]}).encode()

    def serve(drops: int):
        for index in range(drops + 1):
            connection, _ = listener.accept()
            if index < drops:  # a reset (RST), as a full backlog or a restarting server gives
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                connection.close()
                continue
            connection.recv(65536)
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(reply), reply)
            )
            connection.close()

    server = threading.Thread(target=serve, args=(2,), daemon=True)
    server.start()
    ask = url_asker(f"http://127.0.0.1:{port}/v1", "judge", 8, timeout_s=10.0, concurrency=1)
    (outcome,) = ask(["Q"])
    assert (outcome.status, outcome.value) == ("ok", "Score: 4")
    server.join(5)
    listener.close()
    (refused,) = ask(["Q"])  # nothing listens now: refused on every try
    assert refused.status == "error" and "refused" in refused.message.lower()
