"""Multi-turn episodes with tools, token in and token out.

An AgentLoop turns one Episode (a conversation to continue) into a Trajectory, talking to the
model through a GenerationClient. ToolCallingLoop is the built-in one: generate a turn, parse
its tool calls, run the tools concurrently (each with a timeout), append their results as
`tool` messages, generate again, until the model answers without a call or a limit is hit.

Token in, token out: the model's own tokens are kept exactly as sampled and never decoded
and re-encoded; only what the chat template adds around the tool results (the "delta") is
tokenized, by rendering the conversation with and without the new messages and encoding the
difference. Re-tokenizing the whole conversation each turn can change the model's tokens
(merges across turn boundaries, a template that rewrites the assistant's text), so the
trained log-probs would belong to tokens the model never sampled.

An episode may carry its first prompt's images (a vision-language model): agents/images.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridflow.agents.images import (
    check_text_result,
    image_prompt_ids,
    marked_messages,
)
from hybridflow.agents.parsers import HermesParser, ParsedTurn, ToolCall, ToolCallParser
from hybridflow.agents.sandbox_limits import SandboxError


class TemplateError(ValueError):
    """The chat template does not render a conversation as its prefix plus the new part."""


@dataclass
class Episode:
    messages: list[dict]
    """The conversation so far (system / user messages): the model speaks next."""
    tools: list[str] | None = None
    """Names of the tools this episode may use (None: all the loop has)."""
    seed: int | None = None
    """Base seed of the episode's samples (turn t samples with seed + t)."""
    metadata: dict = field(default_factory=dict)
    """Carried to the Trajectory (data source, ground truth, ...)."""
    images: Any = None
    """The first prompt's images (engine.images.PromptImages), one ``<image>`` placeholder
    each in `messages`, in order; None: a text episode."""


@dataclass
class Turn:
    generated_tokens: int
    finish_reason: str
    """The engine's: "stop" or "length"."""
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that could not be parsed, named an unknown tool, or raised."""
    tool_timeouts: int = 0


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    """Everything after the prompt: the model's tokens and the tool deltas, in order."""
    response_logprobs: list[float]
    """The sampled log-prob of each model token; 0 on delta tokens."""
    loss_mask: list[int]
    """1 on the model's tokens, 0 on tool output and template glue."""
    messages: list[dict]
    """The conversation as text, the model's turns and tool results included."""
    turns: list[Turn]
    finish_reason: str
    """"answer" (a turn without tool calls), "max_turns", "max_tokens" or "length" (the
    last turn ran out of tokens)."""
    metadata: dict = field(default_factory=dict)
    prompt_positions: Any = None
    """An episode with images: mRoPE's position rows [3, len(prompt_ids)] of its prompt (the
    response continues from their largest plus one); None for text."""

    @property
    def final_text(self) -> str:
        """What a reward reads: the answer an agent program returned (metadata
        "final_text"), else the model's last message."""
        if isinstance(self.metadata.get("final_text"), str):
            return self.metadata["final_text"]
        for message in reversed(self.messages):
            if message["role"] == "assistant":
                return message["content"]
        return ""

    def metrics(self) -> dict[str, float]:
        masked = len(self.loss_mask) - sum(self.loss_mask)
        return {
            "turns": len(self.turns),
            "tool_calls": sum(t.tool_calls for t in self.turns),
            "tool_errors": sum(t.tool_errors for t in self.turns),
            "tool_timeouts": sum(t.tool_timeouts for t in self.turns),
            "masked_token_fraction": masked / max(1, len(self.loss_mask)),
            "response_tokens": len(self.response_ids),
        }


class GenerationClient(Protocol):
    """What a loop needs from the engine: one completion of one prompt (token ids). A client
    that also has `close_session` (EngineClient) takes `session=`: the turns of one episode
    then continue its kept KV instead of prefilling the conversation again."""

    async def generate(self, prompt_ids: list[int], params) -> Any:
        """-> an engine Completion (token_ids, logprobs, finish_reason)."""
        ...


class AgentLoop(Protocol):
    async def run(self, episode: Episode, client: GenerationClient) -> Trajectory: ...


class ChatRenderer:
    """The tokenizer's chat template as token ids: the first prompt, and each later delta."""

    def __init__(self, tokenizer, tool_schemas: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tool_schemas = tool_schemas or None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        kwargs = {"tools": self.tool_schemas} if self.tool_schemas else {}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def delta_ids(self, history: list[dict], stop_text: str, new_messages: list[dict]) -> list[int]:
        """Tokens that follow the model's last turn (history[-1], the assistant message whose
        tokens are already in the sequence, ending with stop_text if it emitted a stop
        token): the template's glue after that turn, the new messages, and the next
        generation prompt."""
        assistant = history[-1]["content"]
        before = self.render(history, add_generation_prompt=False)
        after = self.render(history + new_messages, add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template renders the conversation differently once messages are "
                "added, so the new tokens cannot be appended as a delta"
            )
        end = before.rfind(assistant)
        if end < 0:
            raise TemplateError("the chat template changed the assistant's text")
        glue = before[end + len(assistant) :]
        if stop_text and glue.startswith(stop_text):
            glue = glue[len(stop_text) :]  # the model's stop token is in the sequence already
        return self.encode(glue + after[len(before) :])


@dataclass
class LoopLimits:
    max_turns: int = 4
    """Model turns per episode (the last turn's tool calls are not run)."""
    max_tokens: int = 1024
    """Response tokens per episode (model tokens and tool deltas together)."""
    max_tokens_per_turn: int = 256
    tool_timeout_s: float = 10.0
    max_tool_output_chars: int = 4000
    """Longer tool results are cut (the model is told)."""


class ToolCallingLoop:
    """The built-in AgentLoop: tools from `tools` (name -> Tool), calls parsed by `parser`,
    sampling from `sampling` (an engine SamplingParams; n is 1, max_new_tokens per turn comes
    from the limits)."""

    def __init__(self, tokenizer, tools: dict, sampling, *, parser: ToolCallParser | None = None,
                 limits: LoopLimits | None = None, image_merge_size: int | None = None):  # fmt: skip
        from hybridflow.agents.tools import openai_schema

        self.tokenizer = tokenizer
        self.tools = dict(tools)
        self.parser = parser or HermesParser()
        self.limits = limits or LoopLimits()
        self.sampling = sampling
        self.image_merge_size = image_merge_size  # the vision encoder's (episodes with images)
        self._schemas = {name: openai_schema(tool) for name, tool in self.tools.items()}
        self._sessions = itertools.count()
        eos = tokenizer.eos_token_id
        self.stop_ids = set(sampling.stop_token_ids) | ({eos} if eos is not None else set())

    def _renderer(self, episode: Episode) -> ChatRenderer:
        names = list(self.tools) if episode.tools is None else episode.tools
        unknown = [name for name in names if name not in self.tools]
        if unknown:
            raise ValueError(f"episode asks for tools {unknown}; the loop has {sorted(self.tools)}")
        return ChatRenderer(self.tokenizer, [self._schemas[name] for name in names])

    async def run(self, episode: Episode, client: GenerationClient) -> Trajectory:
        if not hasattr(client, "close_session"):
            return await self._run(episode, client, {})
        session = ("episode", next(self._sessions))
        try:
            return await self._run(episode, client, {"session": session})
        finally:
            await client.close_session(session)

    async def _run(self, episode: Episode, client: GenerationClient, session: dict) -> Trajectory:
        limits = self.limits
        renderer = self._renderer(episode)
        allowed = set(self.tools) if episode.tools is None else set(episode.tools)
        messages = [dict(m) for m in episode.messages]
        prompt, positions = self._prompt(renderer, episode, messages)
        if episode.images is not None:  # every turn: its first prompt's images (their span)
            images = dataclasses.replace(episode.images, image_span=len(prompt))
            session = {**session, "images": images}
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        turns: list[Turn] = []
        finish = "max_turns"
        for turn_index in range(limits.max_turns):
            budget = min(limits.max_tokens_per_turn, limits.max_tokens - len(ids))
            if budget <= 0:
                finish = "max_tokens"
                break
            seed = None if episode.seed is None else episode.seed + turn_index
            params = dataclasses.replace(self.sampling, n=1, max_new_tokens=budget, seed=seed)
            completion = await client.generate(prompt + ids, params, **session)
            tokens = list(completion.token_ids)
            ids += tokens
            logprobs += list(completion.logprobs)
            mask += [1] * len(tokens)
            stopped = bool(tokens) and tokens[-1] in self.stop_ids
            text = self.tokenizer.decode(tokens[:-1] if stopped else tokens,
                                         skip_special_tokens=False)  # fmt: skip
            messages.append({"role": "assistant", "content": text})
            parsed = self.parser.parse(text)
            turn = Turn(
                len(tokens), completion.finish_reason, len(parsed.calls), len(parsed.errors)
            )
            turns.append(turn)
            if not parsed.calls and not parsed.errors:
                finish = "answer"
                break
            if turn_index + 1 == limits.max_turns:
                break  # no turn left to read the results
            results = await self._run_tools(parsed, allowed, turn)
            stop_text = (
                self.tokenizer.decode(tokens[-1:], skip_special_tokens=False) if stopped else ""
            )
            delta = renderer.delta_ids(messages, stop_text, results)
            if len(ids) + len(delta) >= limits.max_tokens:
                finish = "max_tokens"
                break
            messages += results
            ids += delta
            logprobs += [0.0] * len(delta)
            mask += [0] * len(delta)
        else:
            finish = "max_turns"
        if finish == "answer" and turns and turns[-1].finish_reason == "length":
            finish = "length"
        return Trajectory(prompt, ids, logprobs, mask, messages, turns, finish,
                          dict(episode.metadata), positions)  # fmt: skip

    def _prompt(self, renderer: ChatRenderer, episode: Episode, messages: list[dict]):
        """(the first prompt's ids, its mRoPE rows or None); an episode with images gets its
        vision tokens in `messages` (in place) and in the ids (agents/images.py)."""
        if episode.images is None:
            return renderer.prompt_ids(messages), None
        if self.image_merge_size is None:
            raise ValueError("an episode with images needs the loop's image_merge_size (the "
                             "vision encoder's spatial_merge_size)")  # fmt: skip
        messages[:] = marked_messages(messages)
        prompt = image_prompt_ids(self.tokenizer, renderer.prompt_ids(messages),
                                  episode.images.image_grid_thw, self.image_merge_size)  # fmt: skip
        return prompt.ids, prompt.positions

    async def _run_tools(self, parsed: ParsedTurn, allowed: set[str], turn: Turn) -> list[dict]:
        """One `tool` message per call (and per unreadable call), in the calls' order; the
        calls run concurrently. Errors and timeouts are answered to the model, not raised."""
        outcomes = await asyncio.gather(*(self._call(call, allowed) for call in parsed.calls))
        messages = []
        for call, (content, status) in zip(parsed.calls, outcomes):
            turn.tool_errors += status == "error"
            turn.tool_timeouts += status == "timeout"
            messages.append({"role": "tool", "name": call.name, "content": content})
        for error in parsed.errors:
            messages.append({"role": "tool", "name": "error", "content": f"Error: {error}"})
        return messages

    async def _call(self, call: ToolCall, allowed: set[str]) -> tuple[str, str]:
        tool = self.tools.get(call.name) if call.name in allowed else None
        if tool is None:
            known = ", ".join(sorted(allowed)) or "none"
            return f"Error: unknown tool {call.name!r} (tools: {known})", "error"
        timeout = self.limits.tool_timeout_s
        try:
            result = await asyncio.wait_for(tool(call.arguments), timeout)
        except asyncio.TimeoutError:
            return f"Error: {call.name} took longer than {timeout:g} s", "timeout"
        except SandboxError:  # the sandbox cannot run programs here: ours to fix, stop the run
            raise
        except Exception as error:  # a tool's failure is the model's information, not ours
            return f"Error: {call.name} failed: {type(error).__name__}: {error}", "error"
        check_text_result(call.name, result)  # an image: the tool's author's to fix, stop
        text = result if isinstance(result, str) else json.dumps(result)
        cap = self.limits.max_tool_output_chars
        if len(text) > cap:
            text = text[:cap] + f"\n[output cut at {cap} characters]"
        return text, "ok"


async def run_episodes(loop: AgentLoop, episodes: list[Episode], client: GenerationClient,
                       concurrency: int = 256) -> list[Trajectory]:  # fmt: skip
    """Every episode through `loop`, at most `concurrency` at once, results in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(episode):
        async with gate:
            return await loop.run(episode, client)

    return list(await asyncio.gather(*(one(e) for e in episodes)))
