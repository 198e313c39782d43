"""The HTTP plumbing of the server: JSON bodies in, OpenAI's JSON errors out (never a
traceback), Server-Sent Events; every body it writes is strict JSON (no NaN or Infinity,
which JSON parsers refuse)."""

from __future__ import annotations

import asyncio
import json
import logging
import math

from aiohttp import web

from hybridflow.serve.json_text import lone_surrogate, surrogate_message
from hybridflow.serve.openai_protocol import RequestError, error_body

log = logging.getLogger("hybridflow.serve")


async def read_json(request: web.Request, max_bytes: int, timeout_s: float) -> dict:
    """The request's JSON object body: 413 when it is larger than max_bytes (by its
    Content-Length, before reading; else as soon as the bytes read pass it), 408 when it has
    not all arrived timeout_s after the headers (limits.py)."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise too_large(f"{declared} bytes", max_bytes)
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise too_large(f"over {max_bytes} bytes", max_bytes) from None
    except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
        raise RequestError(f"the request body did not arrive within {timeout_s:g} s of its "
                           "headers", None, "request_timeout", status=408) from None  # fmt: skip
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError
        raise RequestError(f"the request body is not valid JSON: {error}", None,
                           "invalid_json") from None  # fmt: skip
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_json")
    surrogate = lone_surrogate(body)
    if surrogate is not None:
        raise RequestError(surrogate_message(*surrogate), surrogate[0] or None, "invalid_unicode")
    return body


def finite_dumps(value) -> str:
    """``value`` as strict JSON: a non-finite float (NaN, ±inf, which json.dumps would write
    as the invalid tokens NaN / Infinity) becomes null."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:  # rare: a NaN somewhere; walk the value once
        return json.dumps(_finite(value), allow_nan=False)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def json_response(value, **kwargs) -> web.Response:
    """aiohttp's json_response, written by :func:`finite_dumps`."""
    return web.json_response(value, dumps=finite_dumps, **kwargs)


def too_large(size: str, max_bytes: int) -> RequestError:
    return RequestError(
        f"the request body has {size}; this server takes at most {max_bytes} bytes, room for "
        "the longest prompt its context can hold. Send less (split a batch of prompts into "
        "several requests), or start the server with a larger --max-request-bytes",
        None, "request_too_large", status=413,
    )  # fmt: skip


def generation_failed(error: Exception) -> RequestError:
    return RequestError(f"generation failed: {type(error).__name__}: {error}", None,
                        "generation_failed", status=500, type="server_error")  # fmt: skip


async def stream_events(request: web.Request, events) -> web.StreamResponse:
    """Server-Sent Events: `data: {json}` per event (an iterable or an async iterable),
    then `data: [DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})  # fmt: skip
    await response.prepare(request)
    try:
        if not hasattr(events, "__aiter__"):
            events = _async_iter(events)
        async for event in events:
            await response.write(b"data: " + finite_dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except (ConnectionError, asyncio.CancelledError):  # the client went away mid-stream
        log.info("stream to %s ended early: the client disconnected", request.remote)
    return response


async def _async_iter(items):
    for item in items:
        yield item


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every error as OpenAI's JSON error body; never a traceback to the client."""
    try:
        return await handler(request)
    except RequestError as error:
        response = web.json_response(error.body(), status=error.status)
        if error.status in (408, 413):  # the rest of the body is not read: the connection ends
            response.force_close()
        return response
    except web.HTTPException as error:
        if error.status < 400:
            raise
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        text = error.text or ""
        message = (text if text and not text.startswith(f"{error.status}:")
                   else f"{error.reason}: {request.method} {request.path}")  # fmt: skip
        headers = {k: v for k, v in error.headers.items() if k.lower() == "allow"}
        body = error_body(message, kind, None, _HTTP_CODES.get(error.status))
        return web.json_response(body, status=error.status, headers=headers)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        body = error_body("internal server error", "server_error", None, "internal_error")
        return web.json_response(body, status=500)
