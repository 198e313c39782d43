"""EngineClient: the GenerationClient that agent loops (and the server) talk to, over one
Engine's RolloutService.

Hundreds of episodes run as asyncio tasks; each turn awaits one request. The requests made
in one tick of the event loop (the turns of every episode whose tool just returned) go to the
engine's service in one post (RolloutService.submit_many): one wake-up and one lock of the
engine's thread for all of them, not one each. A request joins the running batch at the next
step, decodes beside the other episodes' turns with its own
sampling settings and seed (so it samples what it would alone), and its task resumes when it
finishes, while tools keep running on the event loop.

Sessions: the turns of one conversation name the same `session`; each turn's KV stays in its
slot (kept KV, engine/scheduling/kept.py), so the next turn prefills only the tokens added since (the
tool's result), and `close_session` gives the slot back.
"""

from __future__ import annotations

import asyncio


class EngineClient:
    """engine: hybridflow.engine.Engine. Uses the engine's running RolloutService, or starts
    one (and then stops it at close())."""

    def __init__(self, engine):
        from hybridflow.engine.serving.service import RolloutService

        self.engine = engine
        self._owns_service = engine.service is None
        self.service = engine.service or RolloutService(engine)
        self._handles: dict = {}  # session -> kv handle of its last turn
        self.requests = 0  # requests submitted (for metrics and tests)
        self.posts = 0  # posts to the service that carried them (one per event-loop tick)
        self._pending: list[tuple[dict, asyncio.Future]] = []  # this tick's requests

    async def generate(self, prompt_ids: list[int], params, session=None, images=None):
        """One completion of prompt_ids (params.n must be 1). session: any hashable naming
        the conversation; its last turn's KV is continued when prompt_ids extends it.
        images: the prompt's engine.images.PromptImages, sent with every turn of a session
        (a turn continues the kept KV with its text; one that cannot is prefilled in full)."""
        if params.n != 1:
            raise ValueError(f"EngineClient.generate takes n=1 requests, got n={params.n}")
        reuse = self._handles.pop(session, None) if session is not None else None
        handle = await self._submit(dict(prompt_ids=prompt_ids, params=params,
                                         keep=session is not None, reuse=reuse,
                                         images=images))  # fmt: skip
        try:
            completion = (await handle)[0]
        except BaseException:
            handle.abort()  # the episode was cancelled (or the engine failed): free its row
            raise
        if session is not None and completion.kv_handle is not None:
            self._handles[session] = completion.kv_handle
        return completion

    def _submit(self, request: dict) -> asyncio.Future:
        """A future of the request's handle, posted with the rest of this tick's requests
        (call_soon runs after every callback already due in this tick)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            loop.call_soon(self._post_pending)
        self._pending.append((request, future))
        self.requests += 1
        return future

    def _post_pending(self) -> None:
        pending, self._pending = self._pending, []
        try:
            outcomes = self.service.submit_many([request for request, _ in pending])
        except BaseException as error:  # the service is closed: every request hears it
            outcomes = [error] * len(pending)
        self.posts += 1
        for (_, future), outcome in zip(pending, outcomes):
            if future.cancelled():  # its episode went away meanwhile
                if not isinstance(outcome, BaseException):
                    outcome.abort()
            elif isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    def stream(self, prompt_ids: list[int], params, images=None):
        """A RequestHandle whose astream() yields the new tokens as they are decoded (all
        params.n samples; abort() it when the reader goes away). images: as generate's."""
        self.requests += 1
        return self.service.submit(prompt_ids, params, stream=True, images=images)

    async def close_session(self, session) -> None:
        """The conversation is over: its kept slot goes back."""
        handle = self._handles.pop(session, None)
        if handle is not None:
            self.service.release_kept([handle])

    def close(self) -> None:
        """Give back every slot this client kept; stop the service if this client started it."""
        handles, self._handles = list(self._handles.values()), {}
        if self.engine.service is None:  # closed elsewhere: the engine is its own again
            self.engine.release_kept(handles)
            return
        self.service.release_kept(handles)
        if self._owns_service:
            self.service.close()
