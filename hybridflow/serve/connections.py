"""Connections that cannot be held by a slow client: a deadline on each request's headers.

aiohttp waits for a request's headers as long as the client keeps the connection open, so a
client sending one byte every few seconds ("slowloris") holds a socket, and many such
clients hold them all. Each connection is wrapped in HeaderDeadline: from the connect, and
again from the end of each response (a kept-alive connection), the client has
`header_timeout_s` to send the next request's line and headers; then the connection is
closed, with a 408 if the connection's first request had begun to arrive. So an idle
connection is also closed after header_timeout_s, as uvicorn's and Node's 5 s keep-alive
do. The body's own deadline is in http.read_json.

The wrapper forwards asyncio's Protocol calls to aiohttp's RequestHandler unchanged; the
request's handler marks the headers in through `headers_in` (the middleware
`request_deadlines`, which finds the wrapper as the transport's protocol).
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from hybridflow.serve.openai_protocol import error_body

log = logging.getLogger("hybridflow.serve")


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps(error_body(f"the request's headers did not arrive within {timeout_s:g} s",
                                 code="request_timeout")).encode()  # fmt: skip
    head = (f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


class HeaderDeadline(asyncio.Protocol):
    """aiohttp's protocol for one connection (`inner`), closed when a request's headers take
    longer than header_timeout_s (module docstring)."""

    def __init__(self, inner: asyncio.Protocol, header_timeout_s: float):
        self.inner = inner
        self.header_timeout_s = header_timeout_s
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False  # between headers_in and request_done
        self._bytes_since_armed = False  # a request has begun arriving (else: idle)
        self._served = 0  # requests answered on this connection

    # -- asyncio.Protocol, forwarded ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._timer is None and not self._in_request:
            self._arm()  # the first byte of the next request on a kept-alive connection
        self._bytes_since_armed = True
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- the deadline ------------------------------------------------------------------------

    def headers_in(self) -> None:
        """The request's headers are in: its handler runs (the body has its own deadline)."""
        self._disarm()
        self._in_request = True

    def request_done(self) -> None:
        """The response is out: the connection idles until the next request, which (or its
        first byte, if it is already buffered) must come within header_timeout_s."""
        self._in_request = False
        self._served += 1
        self._disarm()
        self._arm()

    def _arm(self) -> None:
        self._bytes_since_armed = False
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        transport = self.transport
        if self._in_request or transport is None or transport.is_closing():
            return
        # A first request that began and stalled is told why it is cut. After a response,
        # bytes may be the rest of a body the server did not read: no second answer then.
        if self._bytes_since_armed and not self._served:
            peer = transport.get_extra_info("peername")
            log.info("closing the connection of %s: its request's headers took over %g s",
                     peer, self.header_timeout_s)  # fmt: skip
            transport.write(_timeout_response(self.header_timeout_s))
        transport.close()


@web.middleware
async def request_deadlines(request: web.Request, handler):
    """Tell the connection's HeaderDeadline that this request's headers are in."""
    transport = request.transport
    deadline = transport.get_protocol() if transport is not None else None
    if not isinstance(deadline, HeaderDeadline):  # served without start_site (a test app)
        return await handler(request)
    deadline.headers_in()
    try:
        return await handler(request)
    finally:
        deadline.request_done()
