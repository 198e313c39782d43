"""Slow and vanishing clients: a client sending its headers or its body byte by byte, or
nothing, is cut off after the timeout; a client that goes away mid-request has its
generation aborted in the engine."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse

import pytest

from hybridflow.serve.limits import ServerLimits

TIMEOUT_S = 0.5
PATIENCE_S = 20.0
"""How long a test waits for the server to cut a connection: far past TIMEOUT_S, so a slow
machine does not fail it, and far below what an uncut connection lasts (aiohttp's own
keep-alive is 3630 s)."""
CHAT = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture
def strict_server(scripted):
    """A server whose clients have TIMEOUT_S for headers and body: (host, port)."""
    limits = ServerLimits(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S)
    api, _, _ = scripted(["fine"], limits=limits)
    address = urllib.parse.urlsplit(str(api.base_url))
    return address.hostname, address.port


def trickle(address, data: bytes) -> tuple[bytes, float]:
    """trickle_on() a new connection to ``address``."""
    with socket.create_connection(address, timeout=PATIENCE_S) as sock:
        return trickle_on(sock, data)


def trickle_on(sock: socket.socket, data: bytes) -> tuple[bytes, float]:
    """Send `data` a byte every 50 ms on an open connection until the server closes it; ->
    (what the server sent, seconds until it closed). Fails if the whole of `data` went
    through or the connection is still open after PATIENCE_S."""
    start = time.monotonic()
    received = b""
    sock.settimeout(0.05)
    for byte in data:
        if time.monotonic() - start > PATIENCE_S:
            break
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        received += chunk
        if not chunk:
            break
    else:
        pytest.fail("the whole request went through: no timeout cut it")
    sock.settimeout(PATIENCE_S)
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    elapsed = time.monotonic() - start
    assert elapsed < PATIENCE_S, "the connection stayed open"
    return received, elapsed


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_headers_sent_byte_by_byte_are_cut_with_a_408(strict_server):
    headers = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + "X-Slow: y\r\n" * 400
    received, _ = trickle(strict_server, headers.encode())
    status, error = status_and_error(received)
    assert status == 408 and error["code"] == "request_timeout" and "headers" in error["message"]


def test_a_body_sent_byte_by_byte_is_cut_with_a_408(strict_server):
    body = CHAT.encode() + b" " * 2000
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(strict_server) as sock:
        sock.sendall(head)  # the headers at once: only the body is slow
        received, _ = trickle_on(sock, body)
    status, error = status_and_error(received)
    assert status == 408 and error["code"] == "request_timeout" and "body" in error["message"]


def test_a_connection_that_sends_nothing_is_closed(strict_server):
    start = time.monotonic()
    with socket.create_connection(strict_server, timeout=PATIENCE_S) as sock:
        assert sock.recv(1) == b""  # closed by the server, nothing said
    assert time.monotonic() - start < PATIENCE_S


def test_prompt_clients_keep_their_connection_between_requests(strict_server):
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(CHAT)}\r\n\r\n{CHAT}").encode()  # fmt: skip
    with socket.create_connection(strict_server, timeout=PATIENCE_S) as sock:
        for _ in range(3):  # each request well within the timeouts, on one connection
            sock.sendall(request)
            response = b""
            while b'"usage"' not in response:
                chunk = sock.recv(65536)
                assert chunk, "the server closed a connection in use"
                response += chunk
            assert response.startswith(b"HTTP/1.1 200")


def test_an_abandoned_request_is_aborted_in_the_engine(tiny_server, engine_client, monkeypatch):
    service = engine_client.service
    handles = []
    submit, submit_many = service.submit, service.submit_many

    def submitted(*args, **kwargs):
        handles.append(submit(*args, **kwargs))
        return handles[-1]

    def submitted_many(requests):  # the client's path: a tick's requests in one post
        handles.extend(submit_many(requests))
        return handles[-len(requests) :]

    monkeypatch.setattr(service, "submit", submitted)
    monkeypatch.setattr(service, "submit_many", submitted_many)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 400, "ignore_eos": True})  # fmt: skip
    address = urllib.parse.urlsplit(tiny_server.url)
    service.pause()  # nothing decodes: the request waits for its first token
    try:
        with socket.create_connection((address.hostname, address.port)) as sock:
            sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
                          ).encode())  # fmt: skip
            deadline = time.monotonic() + PATIENCE_S
            while not handles and time.monotonic() < deadline:
                time.sleep(0.01)
            assert handles, "the request never reached the engine"
        # the client is gone: the engine ends the request, though it is paused
        (completion,) = handles[0].result(timeout=PATIENCE_S)
    finally:
        service.resume()
    assert completion.finish_reason == "abort" and len(completion.token_ids) == 0
