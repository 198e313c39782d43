"""Episodes from an agent program of yours that speaks the OpenAI API
(`rollout.agent.loop=openai`, `rollout.agent.program=path/to/file.py:function`).

The rollout worker serves its engine on 127.0.0.1 (hybridflow/serve/, a free port) and runs
the program once per episode:

    async def function(client, messages, *, model, extra_info) -> str | None

`client` is an `openai.AsyncOpenAI` pointed at that server, `messages` the row's chat
messages, `model` the name to ask for, `extra_info` the row's extra_info (tool arguments,
test cases, ...). The program calls `client.chat.completions.create(model=model,
messages=...)` as often as it likes, runs its own tools, and returns the final answer (the
text the reward scores; None: the model's last message). Every request of the episode
carries its id (a header the client adds), so the server continues the episode's tokens
instead of re-tokenizing the conversation (serve/episodes.py), samples with the trainer's
settings and seeds, and stops the episode at data.max_response_length response tokens. The
episode's tokens, log-probs and loss mask (1 on the model's tokens) become the trajectory the
RL loop trains on. A program that raises ends its episode; what it generated until then is
kept and the error counted.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid

from hybridflow.agents.loop import ChatRenderer, Trajectory, Turn


class AgentProgramError(ValueError):
    """rollout.agent.program cannot be used as written."""


def load_program(spec: str):
    """`path/to/file.py:function` or `package.module:function` -> the async function."""
    from hybridflow.agents.tools import ToolLoadError, _load_module

    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise AgentProgramError(
            f"rollout.agent.program={spec!r} must look like path/to/file.py:function"
        )
    try:
        module = _load_module(spec, location, what="rollout.agent.program")
    except ToolLoadError as error:
        raise AgentProgramError(str(error)) from None
    function = getattr(module, name, None)
    if function is None or not inspect.iscoroutinefunction(function):
        raise AgentProgramError(
            f"rollout.agent.program={spec!r}: {location} has no async function {name!r} "
            "(async def function(client, messages, *, model, extra_info) -> str | None)"
        )
    return function


class ProgramServer:
    """The engine served over HTTP for agent programs, in a thread of the rollout worker."""

    def __init__(self, engine, tokenizer, model_name: str = "policy"):
        from hybridflow.agents.client import EngineClient
        from hybridflow.serve.app import EPISODES, build_app
        from hybridflow.serve.running import BackgroundServer

        self.model_name = model_name
        self.client = EngineClient(engine)
        app = build_app(engine, tokenizer, model_name, client=self.client)
        self.episodes = app[EPISODES]
        self.server = BackgroundServer(app).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.stop()
        self.client.close()


def run_program_batch(program, server: ProgramServer, tokenizer, raw_prompts: list,
                      extra_infos: list, n: int, seed: int | None, sampling,
                      max_response_length: int, concurrency: int) -> list[Trajectory]:  # fmt: skip
    """n episodes per prompt, prompt-major (row i * n + j is sample j of prompt i)."""
    from hybridflow.agents.rollout import EPISODE_SEED_STRIDE

    jobs = []
    for i, messages in enumerate(raw_prompts):
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        for j in range(n):
            k = i * n + j
            episode_seed = None if seed is None else seed + EPISODE_SEED_STRIDE * k
            jobs.append(([dict(m) for m in messages], dict(extra_infos[i] or {}), episode_seed))

    async def everything():
        import openai

        base = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="hybridflow",
                                  max_retries=0, timeout=None)  # fmt: skip
        gate = asyncio.Semaphore(concurrency)

        async def one(messages, extra_info, episode_seed):
            async with gate:
                return await _episode(program, base, server, tokenizer, messages, extra_info,
                                      episode_seed, sampling, max_response_length)  # fmt: skip

        try:
            return list(await asyncio.gather(*(one(*job) for job in jobs)))
        finally:
            await base.close()

    return asyncio.run(everything())


async def _episode(program, base, server: ProgramServer, tokenizer, messages, extra_info,
                   episode_seed, sampling, max_response_length: int) -> Trajectory:  # fmt: skip
    from hybridflow.serve.episodes import EPISODE_HEADER

    episode = uuid.uuid4().hex
    server.episodes.open(episode, sampling=sampling, seed=episode_seed,
                         max_tokens=max_response_length)  # fmt: skip
    client = base.with_options(default_headers={EPISODE_HEADER: episode})
    answer, error = None, None
    try:
        answer = await program(client, [dict(m) for m in messages], model=server.model_name,
                               extra_info=extra_info)  # fmt: skip
    except Exception as failure:  # the program's failure ends its episode, not the run
        error = f"{type(failure).__name__}: {failure}"
    finally:
        state = server.episodes.pop(episode)
        await server.client.close_session(("episode", episode))
    if not state.prompt_ids:  # the program never asked the model
        state.prompt_ids = ChatRenderer(tokenizer).prompt_ids(messages)
        state.messages = list(messages)
    metadata = {"restarts": state.restarts}
    if isinstance(answer, str):
        metadata["final_text"] = answer
    if error is not None:
        metadata["program_error"] = error
    turns = [Turn(generated, reason) for generated, reason in state.turns]
    finish = "error" if error is not None else "answer"
    if finish == "answer" and turns and turns[-1].finish_reason == "length":
        finish = "length"
    return Trajectory(state.prompt_ids, state.response_ids[:max_response_length],
                      state.logprobs[:max_response_length], state.loss_mask[:max_response_length],
                      state.messages, turns, finish, metadata)  # fmt: skip
