"""Running the server: in a background thread on a free port (tests, an agent program next to
a training run) or in the foreground until interrupted (`hybridflow serve`)."""

from __future__ import annotations

import asyncio
import socket
import threading

from aiohttp import web

from hybridflow.serve.connections import HeaderDeadline
from hybridflow.serve.limits import ServerLimits

LINGERING_S = 2.0
"""Seconds a connection is still read (and the bytes dropped) after a response that left the
request body unread (a 413, a 408), so the client reads the answer before the close; aiohttp's
default of 10 s would hold a slow client that much longer."""


class Listening:
    """A served app: the port bound, and close() to stop (connections, then the app's
    cleanup: build_app's own generation client is closed there)."""

    def __init__(self, runner: web.AppRunner, server: asyncio.AbstractServer):
        self.runner, self.server = runner, server
        self.port: int = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.server.close()
        await self.runner.cleanup()


async def start_site(app: web.Application, host: str | None = None, port: int | None = None,
                     sock: socket.socket | None = None) -> Listening:  # fmt: skip
    """Serve `app` on host:port (port 0: a free one) or on a socket already bound (`sock`).

    A client that disconnects has its request's handler cancelled (so its generation is
    aborted), and every connection has the header deadline of the app's ServerLimits
    (connections.py)."""
    from hybridflow.serve.app import LIMITS

    limits = app.get(LIMITS) or ServerLimits()
    runner = web.AppRunner(app, handler_cancellation=True, lingering_time=LINGERING_S)
    await runner.setup()
    protocol = runner.server

    def connection() -> HeaderDeadline:
        return HeaderDeadline(protocol(), limits.header_timeout_s)

    loop = asyncio.get_running_loop()
    try:
        if sock is not None:
            server = await loop.create_server(connection, sock=sock)
        else:
            server = await loop.create_server(connection, host, port)
    except BaseException:
        await runner.cleanup()
        raise
    return Listening(runner, server)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); OSError when it cannot be bound
    (the port is taken, the address is not this machine's). `hybridflow serve` binds before it
    loads the model, so a taken port is said at once."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


class BackgroundServer:
    """`app` served from a thread with its own event loop, for tests and a trainer
    in-process: `with BackgroundServer(app) as server:` then point an OpenAI client at
    `server.url + "/v1"`. port 0 (the default) binds a free port; `url` names it."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread = threading.Thread(target=self._run, name="hybridflow-serve", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            listening = loop.run_until_complete(start_site(self.app, self.host, self.port))
            self.port = listening.port
        except BaseException as error:  # e.g. the port is taken: start() raises it
            self._error = error
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(listening.close())
            loop.close()

    def stop(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


async def serve_forever(app: web.Application, sock: socket.socket, on_started=None) -> None:
    """Serve on the bound socket until cancelled (Ctrl-C); on_started(url) once serving."""
    listening = await start_site(app, sock=sock)
    try:
        if on_started is not None:
            host = sock.getsockname()[0]
            shown = f"[{host}]" if ":" in host else host
            on_started(f"http://{shown}:{listening.port}")
        await asyncio.Event().wait()
    finally:
        await listening.close()
