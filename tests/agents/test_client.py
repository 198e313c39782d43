"""EngineClient (agents/client.py): the requests of one event-loop tick reach the rollout
service in one post, and each samples what it samples alone (CPU, fp32 eager)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from hybridflow.agents.client import EngineClient
from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

EAGER = EngineOptions(decode_backend="torch", cuda_graphs=False, steps_per_sync=2)
PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12],
           [8, 8, 9], [70, 71, 72, 73]]  # fmt: skip
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.3, generator=generator)
    return model


@pytest.mark.parametrize("per_step", [0, 8])
def test_one_tick_of_requests_is_one_post_and_each_samples_as_alone(model, per_step):
    options = dataclasses.replace(EAGER, max_prefill_tokens_per_step=per_step)
    alone = Engine(model, 8, 64, options=EAGER)
    expected = [alone.generate([p], dataclasses.replace(PARAMS, seed=i))[0]
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    client = EngineClient(Engine(model, 8, 64, options=options))
    posts = []
    post = client.service._post
    client.service._post = lambda task: posts.append(task) or post(task)

    async def one_tick():
        bad = client.generate([10**9], PARAMS)  # an id out of the vocabulary: its own error
        turns = [client.generate(p, dataclasses.replace(PARAMS, seed=i), session=i)
                 for i, p in enumerate(PROMPTS)]  # fmt: skip
        return await asyncio.gather(bad, *turns, return_exceptions=True)

    bad, *got = asyncio.run(one_tick())
    assert len(posts) == 1  # one post carried the tick's requests
    client.close()
    assert isinstance(bad, ValueError)
    assert client.requests == len(PROMPTS) + 1 and client.posts == 1
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_requests_finishing_in_one_step_wake_their_event_loop_once(model):
    """Six turns admitted together, with one budget, finish at one read-back: one
    call_soon_threadsafe wakes their six tasks (not one each: handles.Wakeups)."""
    client = EngineClient(Engine(model, 8, 64, options=EAGER))

    async def one_burst():
        loop = asyncio.get_running_loop()
        wakes = []
        post = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args, **kw: wakes.append(args) or post(*args, **kw)
        done = await asyncio.gather(*(client.generate(p, dataclasses.replace(PARAMS, seed=i))
                                      for i, p in enumerate(PROMPTS)))  # fmt: skip
        return done, wakes

    done, wakes = asyncio.run(one_burst())
    client.close()
    assert [len(c.token_ids) for c in done] == [PARAMS.max_new_tokens] * len(PROMPTS)
    assert len(wakes) == 1 and client.service.wakeups.posts >= 1
