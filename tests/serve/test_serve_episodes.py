"""Episodes (serve/episodes.py): requests that name their episode continue its tokens (the
earlier prompt, every sampled token, the template's delta), whatever text the program sends
back for the model's turns; the trainer's sampling and token budget apply."""

from __future__ import annotations

import openai
import pytest
from serve_helpers import TOKENIZER

from hybridflow.engine import SamplingParams
from hybridflow.serve.app import EPISODES
from hybridflow.serve.episodes import EPISODE_HEADER, extends


def _client(server, episode: str):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                         default_headers={EPISODE_HEADER: episode})  # fmt: skip


def test_a_second_turn_continues_the_episode_tokens_not_a_re_rendering(tiny_server, records):
    tracker = tiny_server.app[EPISODES]
    api = _client(tiny_server, "ep-1")
    messages = [{"role": "user", "content": "12+34="}]
    first = api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=3)
    one = records.get(first.id).choices[0]
    # the program sends the model's turn back rewritten (as agent programs may) plus a tool
    messages += [{"role": "assistant", "content": "REWRITTEN"},
                 {"role": "tool", "name": "calc", "content": "46"}]  # fmt: skip
    second = api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=4)
    two = records.get(second.id).choices[0]
    state = tracker.pop("ep-1")
    sampled = list(one.token_ids)
    prompt = list(one.prompt_token_ids)
    assert list(two.prompt_token_ids[: len(prompt) + len(sampled)]) == prompt + sampled
    delta = list(two.prompt_token_ids[len(prompt) + len(sampled) :])
    assert "46" in TOKENIZER.decode(delta) and "REWRITTEN" not in TOKENIZER.decode(delta)
    assert state.prompt_ids == prompt
    assert state.response_ids == sampled + delta + list(two.token_ids)
    assert state.loss_mask == [1] * len(sampled) + [0] * len(delta) + [1] * len(two.token_ids)
    assert state.logprobs[: len(sampled)] == list(one.logprobs)
    assert state.restarts == 0 and len(state.turns) == 2


def test_rewritten_history_restarts_and_the_trainer_sampling_and_budget_apply(tiny_server,
                                                                              records):  # fmt: skip
    tracker = tiny_server.app[EPISODES]
    trainer = SamplingParams(temperature=1.0, max_new_tokens=999, ignore_eos=True)
    tracker.open("ep-2", sampling=trainer, seed=77, max_tokens=10)
    api = _client(tiny_server, "ep-2")
    first = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                        temperature=0.0, max_tokens=50)  # fmt: skip
    kept = records.get(first.id).choices[0]
    assert len(kept.token_ids) == 10  # the episode's budget, not the request's max_tokens
    # another user message than the episode holds: not a continuation
    other = [{"role": "user", "content": "b"}, {"role": "assistant", "content": "x"},
             {"role": "user", "content": "c"}]  # fmt: skip
    api.chat.completions.create(model="tiny", messages=other, max_tokens=4)
    assert tracker.pop("ep-2").restarts == 1
    # the trainer's settings: temperature 1 with seed 77 for turn 0, whatever was asked
    again = _client(tiny_server, "ep-3")
    tracker.open("ep-3", sampling=trainer, seed=77, max_tokens=10)
    same = again.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                         temperature=0.0, max_tokens=50)  # fmt: skip
    assert list(records.get(same.id).choices[0].token_ids) == list(kept.token_ids)
    tracker.pop("ep-3")


def test_an_episode_request_takes_n_1(tiny_server):
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        _client(tiny_server, "ep-4").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a"}], n=2, max_tokens=2
        )


def test_extends_compares_roles_and_what_the_program_wrote():
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "t"}]
    assert extends(history, history[:1] + [{"role": "assistant", "content": "other"},
                                           {"role": "tool", "content": "r"}])  # fmt: skip
    assert not extends(history, history)  # nothing new
    assert not extends(history, [{"role": "user", "content": "Q"}, *history[1:], history[0]])
    assert not extends(history, [history[0], {"role": "user", "content": "t"}, history[0]])
