"""Running the server: in a background thread on a free port (tests, an agent program next to
a training run) or in the foreground until interrupted (`hybridflow serve`)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: a free port); -> (runner, the port bound)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


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
            runner, self.port = loop.run_until_complete(start_site(self.app, self.host, self.port))
        except BaseException as error:  # e.g. the port is taken: start() raises it
            self._error = error
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
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


async def serve_forever(app: web.Application, host: str, port: int, on_started=None) -> None:
    """Serve until cancelled (Ctrl-C); on_started(url) once the port is bound."""
    runner, port = await start_site(app, host, port)
    try:
        if on_started is not None:
            shown = f"[{host}]" if ":" in host else host
            on_started(f"http://{shown}:{port}")
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
