"""One request cannot exhaust the server: a body larger than the context could use is answered
413 before it is read, a prompt text too long to fit is refused before it is tokenized, and
memory held while refusing them is about the size of the limit, then given back."""

from __future__ import annotations

import gc
import json
import socket
import tracemalloc
import urllib.parse

import pytest
from serve_helpers import MAX_SEQ_LEN, TOKENIZER

from hybridflow.serve.limits import CHARS_PER_TOKEN, ServerLimits

LIMIT = ServerLimits().request_bytes(MAX_SEQ_LEN)  # what the tiny server takes: ~1.1 MB
MAX_CHARS = MAX_SEQ_LEN * CHARS_PER_TOKEN
USER = [{"role": "user", "content": "hi"}]


def exchange(url: str, head: str, body_parts=(), timeout: float = 30) -> tuple[int, dict]:
    """Send `head` (request line and headers, without the blank line) and the body parts on
    a raw socket; -> (status, JSON body) of the response. The server may close while parts
    are still being sent (it answered already): the rest is not sent."""
    address = urllib.parse.urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n")
        try:
            for part in body_parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data:
                    head_part, _, rest = data.partition(b"\r\n\r\n")
                    length = next(int(line.split(b":")[1]) for line in head_part.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))  # fmt: skip
                    if len(rest) >= length:
                        break
        except ConnectionResetError:
            pass
    head_part, _, rest = data.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(rest)


def post_head(path: str, length: int | None) -> str:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}"


def chunked(data: bytes, size: int = 65536):
    for start in range(0, len(data), size):
        piece = data[start : start + size]
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    yield b"0\r\n\r\n"


class PeakMemory:
    """Python memory the process allocates while inside: peak and what stays (tracemalloc:
    the server's thread is in this process)."""

    def __enter__(self):
        gc.collect()
        tracemalloc.start()
        self.before = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc):
        gc.collect()
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.peak, self.kept = peak - self.before, current - self.before


def test_limit_is_sized_from_the_context():
    # 512 tokens x 32 characters x 6 bytes (a JSON \\u escape) + 1 MiB for the rest
    assert LIMIT == 512 * 32 * 6 + 2**20
    assert ServerLimits(max_request_bytes=5000).request_bytes(MAX_SEQ_LEN) == 5000
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServerLimits(header_timeout_s=float("nan"))


def test_a_body_declared_too_large_is_413_unread(tiny_server):
    with PeakMemory() as memory:  # 50 MB announced, none of it sent
        status, body = exchange(tiny_server.url, post_head("/v1/completions", 50_000_000))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(LIMIT) in body["error"]["message"]
    assert "--max-request-bytes" in body["error"]["message"]
    assert memory.peak < 2**20


def test_a_50_mb_prompt_costs_about_the_limit_and_is_given_back(tiny_server):
    prompt = json.dumps({"model": "tiny", "prompt": "a" * 50_000_000, "max_tokens": 1}).encode()
    with PeakMemory() as memory:  # sent chunked: no Content-Length to refuse it by
        status, body = exchange(tiny_server.url, post_head("/v1/completions", None),
                                chunked(prompt))  # fmt: skip
    del prompt
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert memory.peak < 4 * LIMIT  # not the 50 MB, nor a tokenization of it
    assert memory.kept < 2**20


def test_the_server_answers_after_refusing(client):
    answer = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert answer.usage.completion_tokens <= 2


class CountingTokenizer:
    """TOKENIZER, counting the calls that tokenize."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        value = getattr(TOKENIZER, name)
        if name in ("encode", "apply_chat_template", "__call__"):

            def counted(*args, **kwargs):
                self.calls += 1
                return value(*args, **kwargs)

            return counted
        return value

    def __len__(self):
        return len(TOKENIZER)


@pytest.mark.parametrize("endpoint, fields, param", [
    ("/v1/completions", {"prompt": "a" * (MAX_CHARS + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["ab", "a" * (MAX_CHARS + 1)]}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (MAX_CHARS + 1)}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (MAX_CHARS // 2)},
                                           {"role": "user", "content": "a" * (MAX_CHARS // 2)}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     "messages"),  # the messages fit alone; with the tools' JSON they do not
])  # fmt: skip
def test_a_prompt_text_that_cannot_fit_is_refused_before_tokenizing(scripted, endpoint, fields,
                                                                      param):  # fmt: skip
    tokenizer = CountingTokenizer()
    api, fake, _ = scripted(["x"], tokenizer=tokenizer, max_seq_len=MAX_SEQ_LEN, vocab_size=128)
    tokenizer.calls = 0
    body = json.dumps({"model": "scripted", "max_tokens": 2, **fields}).encode()
    status, answer = exchange(str(api.base_url), post_head(endpoint, len(body)), [body])
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert answer["error"]["param"] == param
    assert str(MAX_CHARS) in answer["error"]["message"]
    assert tokenizer.calls == 0 and fake.prompts == []


def test_a_prompt_text_within_the_bound_is_tokenized_and_measured_in_tokens(scripted):
    tokenizer = CountingTokenizer()
    api, _, _ = scripted(["x"], tokenizer=tokenizer, max_seq_len=MAX_SEQ_LEN, vocab_size=128)
    tokenizer.calls = 0
    body = json.dumps({"model": "scripted", "prompt": "a" * MAX_CHARS}).encode()
    status, answer = exchange(str(api.base_url), post_head("/v1/completions", len(body)), [body])
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert f"has {MAX_CHARS} tokens" in answer["error"]["message"] and tokenizer.calls == 1
