"""RequestHandle: what RolloutService.submit returns, usable from threads and asyncio alike.

    handle = service.submit(prompt_ids, params)
    completions = handle.result()            # blocking, or: await handle
    for delta in handle.stream(): ...        # or: async for delta in handle.astream()
    handle.abort()                           # ends it with the tokens generated so far

The engine's thread writes into a handle (new tokens, a finished sample); any number of
other threads and event loops read it. Each change wakes blocked readers (a Condition) and
awaiting tasks (a future on their own loop, resolved with call_soon_threadsafe). A Wakeups
collects the latter over a step of the engine's thread and posts them once per event loop:
each call_soon_threadsafe writes to the loop's self-pipe, a system call that lets the event
loop's thread take the GIL, so one per finished request made the engine's thread wait for
it hundreds of times at an agent turn boundary.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from hybridflow.engine.requests import Completion


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one sample; `completion` is set on the sample's last delta."""

    sample: int
    token_ids: list[int]
    logprobs: list[float]
    completion: Completion | None = None


class Wakeups:
    """Awaiting tasks' futures to resolve, gathered on one thread and posted together: one
    call_soon_threadsafe per event loop per post()."""

    def __init__(self):
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.posts = 0  # call_soon_threadsafe calls made (a counter)

    def add(self, waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
        self._waiters += waiters

    def post(self) -> None:
        waiters, self._waiters = self._waiters, []
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
        for loop, future in waiters:
            by_loop.setdefault(loop, []).append(future)
        for loop, futures in by_loop.items():
            self.posts += 1
            try:
                loop.call_soon_threadsafe(_resolve_all, futures)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass


class RequestHandle:
    """n samples of one prompt in flight (module docstring). wakeups: where the futures of
    awaiting tasks go when it changes (a Wakeups its writer posts); None: posted at once."""

    def __init__(self, n: int, abort=None, wakeups: Wakeups | None = None):
        self.n = n
        self._abort = abort  # callable(sample) on the service, or None
        self._wakeups = wakeups
        self._changed = threading.Condition()
        self._deltas: list[TokenDelta] = []
        self._completions: list[Completion | None] = [None] * n
        self._remaining = n
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # -- written on the engine's thread ---------------------------------------------------------

    def on_tokens(self, sample: int, token_ids: list[int], logprobs: list[float]) -> None:
        with self._changed:
            self._deltas.append(TokenDelta(sample, token_ids, logprobs))
            self._notify()

    def on_finish(self, sample: int, completion: Completion) -> None:
        with self._changed:
            self._completions[sample] = completion
            self._remaining -= 1
            self._deltas.append(TokenDelta(sample, [], [], completion))
            self._notify()

    def on_error(self, error: BaseException) -> None:
        with self._changed:
            self._error = error
            self._notify()

    def _notify(self) -> None:
        self._changed.notify_all()
        waiters, self._waiters = self._waiters, []
        if self._wakeups is not None:
            self._wakeups.add(waiters)
            return
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve_all, [future])

    # -- read anywhere --------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        with self._changed:
            return self._remaining == 0 or self._error is not None

    def abort(self) -> None:
        """End every unfinished sample now (finish_reason 'abort', the tokens so far)."""
        if self._abort is not None and not self.done:
            self._abort()

    def result(self, timeout: float | None = None) -> list[Completion]:
        """The n completions, waiting for them (TimeoutError after `timeout` seconds)."""
        with self._changed:
            if not self._changed.wait_for(self._finished, timeout):
                raise TimeoutError(f"request not finished after {timeout} s")
            return self._outcome()

    def stream(self, timeout: float | None = None):
        """Yield TokenDeltas as the engine reads them back, until every sample is done."""
        seen = 0
        while True:
            with self._changed:
                ready = self._changed.wait_for(
                    lambda seen=seen: len(self._deltas) > seen or self._finished(), timeout
                )
                if not ready:
                    raise TimeoutError(f"no tokens for {timeout} s")
                new, seen = self._deltas[seen:], len(self._deltas)
                over = self._finished() and not new
                if over:
                    self._outcome()  # raises the engine's error, if that ended it
            if over:
                return
            yield from new

    async def astream(self):
        """stream() for asyncio: `async for delta in handle.astream()`."""
        seen = 0
        while True:
            with self._changed:
                new, seen = self._deltas[seen:], len(self._deltas)
                over = self._finished() and not new
                if over:
                    self._outcome()
                future = None if new or over else self._wait_future()
            if over:
                return
            for delta in new:
                yield delta
            if future is not None:
                await future

    async def wait(self) -> list[Completion]:
        """The n completions (asyncio)."""
        while True:
            with self._changed:
                if self._finished():
                    return self._outcome()
                future = self._wait_future()
            await future

    def __await__(self):
        return self.wait().__await__()

    def _finished(self) -> bool:
        return self._remaining == 0 or self._error is not None

    def _outcome(self) -> list[Completion]:
        if self._error is not None:
            raise self._error
        return list(self._completions)

    def _wait_future(self) -> asyncio.Future:
        """A future on the running loop, resolved at the next change (hold the lock)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiters.append((loop, future))
        return future


def _resolve_all(futures: list[asyncio.Future]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
