"""ToolCallingLoop: token in, token out (ids = model tokens + tool deltas, exact masks and
log-probs), tool errors and timeouts answered to the model, limits; EngineClient batching
episodes against a real (tiny) engine with the same tokens as episodes run one by one."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from hybridflow.agents.client import EngineClient
from hybridflow.agents.loop import (
    ChatRenderer,
    Episode,
    LoopLimits,
    TemplateError,
    ToolCallingLoop,
    run_episodes,
)
from hybridflow.agents.sandbox_limits import SandboxError
from hybridflow.agents.templates import with_tool_template
from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.models.tokenizer import build_char_tokenizer

TOKENIZER = with_tool_template(build_char_tokenizer())
EOS = TOKENIZER.eos_token_id


class EchoTool:
    """Returns its argument after `delay` s (or raises / sleeps too long on request)."""

    name = "echo"
    description = "Echo the text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}},
                  "required": ["text"]}  # fmt: skip

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.calls = []

    async def __call__(self, arguments: dict) -> str:
        self.calls.append(arguments)
        await asyncio.sleep(float(arguments.get("sleep", self.delay)))
        if arguments.get("fail"):
            raise RuntimeError("asked to fail")
        return arguments["text"].upper()


class ScriptedClient:
    """Answers turn k with script[k] (text), as model tokens ending in EOS, log-prob -0.5;
    records each prompt it was given."""

    def __init__(self, script: list[str], stop: bool = True):
        self.script, self.stop = list(script), stop
        self.prompts = []

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        text = self.script[len(self.prompts) - 1]
        ids = TOKENIZER.encode(text, add_special_tokens=False)[: params.max_new_tokens - 1]
        ids += [EOS] if self.stop else []
        reason = "stop" if self.stop else "length"
        return SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=reason)


def _loop(tools=None, **limits) -> ToolCallingLoop:
    tools = tools if tools is not None else {"echo": EchoTool()}
    return ToolCallingLoop(TOKENIZER, tools, SamplingParams(temperature=1.0),
                           limits=LoopLimits(**limits))  # fmt: skip


CALL = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
USER = [{"role": "user", "content": "say hi loudly"}]


def test_ids_are_the_model_tokens_and_the_tool_deltas_and_render_the_conversation():
    client = ScriptedClient([f"Let me ask.{CALL}", "It says HI."])
    trajectory = asyncio.run(_loop().run(Episode(USER), client))
    assert trajectory.finish_reason == "answer" and len(trajectory.turns) == 2
    ids, mask = trajectory.response_ids, trajectory.loss_mask
    # the model's tokens stand exactly as sampled, in their places, with their log-probs
    first = TOKENIZER.encode(f"Let me ask.{CALL}", add_special_tokens=False) + [EOS]
    assert ids[: len(first)] == first and all(mask[: len(first)])
    second_start = len(client.prompts[1]) - len(trajectory.prompt_ids)
    assert ids[second_start:] == TOKENIZER.encode("It says HI.", add_special_tokens=False) + [EOS]
    assert mask == [1] * len(first) + [0] * (second_start - len(first)) + [1] * (
        len(ids) - second_start)  # fmt: skip
    assert trajectory.response_logprobs == [-0.5 if m else 0.0 for m in mask]
    # the second turn was asked with exactly the sequence so far: no re-tokenization
    assert client.prompts[1] == trajectory.prompt_ids + ids[:second_start]
    # and the whole sequence is what the template renders for the final conversation
    text = TOKENIZER.decode(trajectory.prompt_ids + ids, skip_special_tokens=False)
    renderer = ChatRenderer(TOKENIZER, [_loop()._schemas["echo"]])
    assert text == renderer.render(trajectory.messages, add_generation_prompt=False).rstrip("\n")
    assert trajectory.messages[2] == {"role": "tool", "name": "echo", "content": "HI"}
    assert trajectory.final_text == "It says HI."
    metrics = trajectory.metrics()
    assert metrics["turns"] == 2 and metrics["tool_calls"] == 1 and metrics["tool_errors"] == 0
    assert metrics["masked_token_fraction"] == (second_start - len(first)) / len(ids)


def test_bad_calls_unknown_tools_failures_and_timeouts_are_answered_not_raised():
    echo = EchoTool()
    turn = ('<tool_call>{"name": "echo", "arguments": {"text": "a"}</tool_call>'  # bad JSON
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "b", "fail": true}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "c", "sleep": 5}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "d"}}</tool_call>')  # fmt: skip
    client = ScriptedClient([turn, "ok"])
    loop = _loop({"echo": echo}, tool_timeout_s=0.2, max_tokens_per_turn=1024, max_tokens=4096)
    trajectory = asyncio.run(loop.run(Episode(USER), client))
    results = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert results[0].startswith("Error: unknown tool 'nope'")
    assert "failed: RuntimeError: asked to fail" in results[1]
    assert "took longer than 0.2 s" in results[2]
    assert results[3] == "D"
    assert results[4].startswith("Error: tool call #1 is not valid JSON")
    turn_stats = trajectory.turns[0]
    assert (turn_stats.tool_calls, turn_stats.tool_errors, turn_stats.tool_timeouts) == (4, 3, 1)
    assert trajectory.finish_reason == "answer"


def test_a_sandbox_that_cannot_run_programs_stops_the_episode_not_answers_the_model():
    class RefusingTool(EchoTool):
        async def __call__(self, arguments: dict) -> str:
            raise SandboxError("strict isolation was asked for, but this machine cannot ...")

    client = ScriptedClient([f"Let me ask.{CALL}", "never asked"])
    with pytest.raises(SandboxError, match="strict isolation was asked for"):
        asyncio.run(_loop({"echo": RefusingTool()}).run(Episode(USER), client))
    assert len(client.prompts) == 1


def test_tool_calls_of_one_turn_run_concurrently():
    calls = "".join(
        f'<tool_call>{{"name": "echo", "arguments": {{"text": "{i}"}}}}</tool_call>'
        for i in range(5))  # fmt: skip
    client = ScriptedClient([calls, "done"])
    t0 = time.perf_counter()
    loop = _loop({"echo": EchoTool(delay=0.3)}, max_tokens_per_turn=1024, max_tokens=4096)
    asyncio.run(loop.run(Episode(USER), client))
    assert time.perf_counter() - t0 < 1.0  # 5 x 0.3 s one after another would be 1.5 s


def test_turn_and_token_limits_end_the_episode():
    client = ScriptedClient([CALL] * 3)
    trajectory = asyncio.run(_loop(max_turns=3).run(Episode(USER), client))
    assert trajectory.finish_reason == "max_turns" and len(trajectory.turns) == 3
    assert sum(1 for m in trajectory.messages if m["role"] == "tool") == 2  # not after turn 3
    short = asyncio.run(_loop(max_tokens=80).run(Episode(USER), ScriptedClient([CALL] * 3)))
    assert short.finish_reason == "max_tokens" and len(short.response_ids) <= 80
    cut = asyncio.run(_loop().run(Episode(USER), ScriptedClient(["no end"], stop=False)))
    assert cut.finish_reason == "length"


def test_an_episode_may_name_only_known_tools():
    with pytest.raises(ValueError, match=r"asks for tools \['web'\]"):
        asyncio.run(_loop().run(Episode(USER, tools=["web"]), ScriptedClient(["x"])))


def test_a_template_that_rewrites_history_is_refused():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (  # puts the message count up front: no prefix is stable
        "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(TemplateError, match="differently once messages are added"):
        renderer.delta_ids([{"role": "user", "content": "a"}, {"role": "assistant",
                           "content": "b"}], "", [{"role": "tool", "content": "c"}])  # fmt: skip


def _tiny_engine():
    model = build_model(preset_config("tiny"), seed=3).eval().requires_grad_(False)
    options = EngineOptions(decode_backend="torch", cuda_graphs=False)
    return Engine(model, max_batch_size=64, max_seq_len=512, options=options)


def test_concurrent_episodes_batch_into_few_engine_calls_and_sample_as_alone():
    """16 episodes through one EngineClient (the tiny random model, its turns cut at 24
    tokens) give the same trajectories as each episode run alone, their turns decoding side
    by side (many rows per decode step)."""
    engine = _tiny_engine()
    loop = ToolCallingLoop(TOKENIZER, {"echo": EchoTool()},
                           SamplingParams(temperature=1.0, stop_token_ids=(EOS,)),
                           limits=LoopLimits(max_turns=3, max_tokens_per_turn=24))  # fmt: skip
    episodes = [Episode([{"role": "user", "content": f"question {i}"}], seed=100 + i)
                for i in range(16)]  # fmt: skip
    client = EngineClient(engine)
    together = asyncio.run(run_episodes(loop, episodes, client))
    scheduler = engine.scheduler
    assert scheduler.decoded_rows / scheduler.decode_steps > 6  # mean rows per step
    client.close()
    for episode, trajectory in zip(episodes[:4], together):
        single = EngineClient(engine)
        alone = asyncio.run(loop.run(episode, single))
        single.close()
        assert alone.response_ids == trajectory.response_ids
        torch.testing.assert_close(alone.response_logprobs, trajectory.response_logprobs,
                                   rtol=0, atol=1e-5)  # fmt: skip
    for trajectory in together:
        assert len(trajectory.response_ids) == len(trajectory.loss_mask)
        assert len(trajectory.prompt_ids) + len(trajectory.response_ids) <= 512


def test_sessions_continue_their_kept_kv_and_sample_the_same_as_full_prefills():
    """8 concurrent conversations of 3 turns (each turn: the completion, then 3 tokens of a
    "tool"): through sessions every turn after the first prefills only the tokens added
    since; the tokens and log-probs equal those of full prefills, and the kept slots are
    given back once the sessions close."""
    params = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True)

    async def conversations(client, use_sessions: bool):
        async def one(i):
            context, outputs = [10 + i, 20 + i, 30], []
            for turn in range(3):
                extra = {"session": i} if use_sessions else {}
                seeded = SamplingParams(**{**vars(params), "seed": 100 * i + turn})
                completion = await client.generate(context, seeded, **extra)
                outputs.append((completion.token_ids, completion.logprobs))
                context = context + completion.token_ids + [40 + turn, 41, 42]
            if use_sessions:
                await client.close_session(i)
            return outputs

        return await asyncio.gather(*(one(i) for i in range(8)))

    results, prefilled = {}, {}
    for use_sessions in (False, True):
        engine = _tiny_engine()
        client = EngineClient(engine)
        results[use_sessions] = asyncio.run(conversations(client, use_sessions))
        prefilled[use_sessions] = engine.prefill_tokens
        if use_sessions:  # given back (at the next chunk boundary)
            asyncio.run(client.generate([5, 6], SamplingParams(max_new_tokens=1)))
            assert len(engine.kept) == 0
        client.close()
    for kept_turns, full_turns in zip(results[True], results[False]):
        for (kept_ids, kept_lp), (full_ids, full_lp) in zip(kept_turns, full_turns):
            assert kept_ids == full_ids
            torch.testing.assert_close(kept_lp, full_lp, rtol=0, atol=1e-5)
    # full: 3 + 11 + 19 tokens a conversation; kept: 3, then 1 + 3 twice
    assert (prefilled[False], prefilled[True]) == (8 * 33, 8 * 11)
