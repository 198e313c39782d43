"""EngineClient: the GenerationClient that agent loops talk to, over one Engine.

Hundreds of episodes run as asyncio tasks; each turn awaits one completion. The client
gathers the requests that arrive together and runs them as one batched `Engine.generate`
call (requests with equal sampling settings share a call; each keeps its own seed, so a
request samples what it would alone), in a worker thread, so tools keep running on the event
loop while the engine decodes. One engine call runs at a time.

Sessions: the turns of one conversation name the same `session`; each turn's KV stays in its
slot (Engine keep/reuse, engine/kept.py), so the next turn prefills only the tokens added
since (the tool's result), and `close_session` gives the slot back.
"""

from __future__ import annotations

import asyncio
import dataclasses

import torch


class EngineClient:
    """engine: hybridflow.engine.Engine. max_batch: requests per engine call (None: all
    waiting). gather_s: how long the first request of a batch waits for others to join."""

    def __init__(self, engine, max_batch: int | None = None, gather_s: float = 0.002):
        self.engine = engine
        self.max_batch = max_batch
        self.gather_s = gather_s
        self._waiting: list[tuple[list[int], object, asyncio.Future, object]] = []
        self._worker: asyncio.Task | None = None
        self._handles: dict = {}  # session -> kv handle of its last turn
        self._released: list[int] = []  # handles to give back before the next engine call
        self.calls = 0  # engine.generate calls made (for metrics and tests)

    async def generate(self, prompt_ids: list[int], params, session=None):
        """One completion of prompt_ids (params.n must be 1). session: any hashable naming
        the conversation; its last turn's KV is continued when prompt_ids extends it."""
        if params.n != 1:
            raise ValueError(f"EngineClient.generate takes n=1 requests, got n={params.n}")
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((list(prompt_ids), params, future, session))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            await asyncio.sleep(self.gather_s)  # let the other episodes' requests join
            cut = len(self._waiting) if self.max_batch is None else self.max_batch
            batch, self._waiting = self._waiting[:cut], self._waiting[cut:]
            groups: dict[tuple, tuple] = {}  # equal sampling settings (seed aside) share a call
            for request in batch:
                params = dataclasses.replace(request[1], seed=None)
                key = (repr(params), request[3] is not None)
                groups.setdefault(key, (params, []))[1].append(request)
            for (_, sessions), (params, requests) in groups.items():
                await self._run(params, requests, sessions)

    def close(self) -> None:
        """Give back every slot this client kept (sessions open or closed). Only with no
        request in flight: it touches the engine from the caller's thread."""
        handles = [*self._released, *self._handles.values()]
        self._released, self._handles = [], {}
        self.engine.release_kept(handles)

    async def close_session(self, session) -> None:
        """The conversation is over: its kept slot goes back (at the next engine call)."""
        handle = self._handles.pop(session, None)
        if handle is not None:
            self._released.append(handle)

    def _call(self, prompts, params, seeds, sessions: bool, reuse):
        """On the engine's thread: give back released slots, then generate."""
        released, self._released = self._released, []
        if released:
            self.engine.release_kept(released)
        if not sessions:
            return self.engine.generate(prompts, params, seeds)
        return self.engine.generate(prompts, params, seeds, keep=True, reuse=reuse)

    async def _run(self, params, requests, sessions: bool) -> None:
        prompts = [prompt for prompt, _, _, _ in requests]
        seeds = [p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)))
                 for _, p, _, _ in requests]  # fmt: skip
        reuse = [self._handles.pop(session, None) for _, _, _, session in requests]
        try:
            completions = await asyncio.to_thread(self._call, prompts, params, seeds, sessions,
                                                  reuse)  # fmt: skip
        except Exception as error:  # every waiting episode learns why
            for _, _, future, _ in requests:
                if not future.done():
                    future.set_exception(error)
            return
        self.calls += 1
        for (_, _, future, session), completion in zip(requests, completions):
            if session is not None and completion.kv_handle is not None:
                self._handles[session] = completion.kv_handle
            if not future.done():
                future.set_result(completion)
