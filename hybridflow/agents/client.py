"""EngineClient: the GenerationClient that agent loops (and the server) talk to, over one
Engine's RolloutService.

Hundreds of episodes run as asyncio tasks; each turn awaits one request. Every request is
submitted to the engine's service as it comes (engine/service.py): it joins the running
batch at the next chunk boundary, decodes beside the other episodes' turns with its own
sampling settings and seed (so it samples what it would alone), and its task resumes when it
finishes, while tools keep running on the event loop.

Sessions: the turns of one conversation name the same `session`; each turn's KV stays in its
slot (kept KV, engine/kept.py), so the next turn prefills only the tokens added since (the
tool's result), and `close_session` gives the slot back.
"""

from __future__ import annotations


class EngineClient:
    """engine: hybridflow.engine.Engine. Uses the engine's running RolloutService, or starts
    one (and then stops it at close())."""

    def __init__(self, engine):
        from hybridflow.engine.service import RolloutService

        self.engine = engine
        self._owns_service = engine.service is None
        self.service = engine.service or RolloutService(engine)
        self._handles: dict = {}  # session -> kv handle of its last turn
        self.requests = 0  # requests submitted (for metrics and tests)

    async def generate(self, prompt_ids: list[int], params, session=None):
        """One completion of prompt_ids (params.n must be 1). session: any hashable naming
        the conversation; its last turn's KV is continued when prompt_ids extends it."""
        if params.n != 1:
            raise ValueError(f"EngineClient.generate takes n=1 requests, got n={params.n}")
        reuse = self._handles.pop(session, None) if session is not None else None
        handle = self.service.submit(prompt_ids, params, keep=session is not None, reuse=reuse)
        self.requests += 1
        try:
            completion = (await handle)[0]
        except BaseException:
            handle.abort()  # the episode was cancelled (or the engine failed): free its row
            raise
        if session is not None and completion.kv_handle is not None:
            self._handles[session] = completion.kv_handle
        return completion

    def stream(self, prompt_ids: list[int], params):
        """A RequestHandle whose astream() yields the new tokens as they are decoded (all
        params.n samples; abort() it when the reader goes away)."""
        self.requests += 1
        return self.service.submit(prompt_ids, params, stream=True)

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
