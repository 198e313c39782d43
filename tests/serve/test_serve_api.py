"""The OpenAI client against the tiny engine's server: chat and completions, seeds, n,
streaming, log-probs, stop strings, and the records of the token ids served. The model has
random weights (gibberish text), so the checks are on structure, counts and determinism."""

from __future__ import annotations

import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from serve_helpers import MAX_SEQ_LEN, TOKENIZER

USER = [{"role": "user", "content": "Say something."}]


def _chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 24)
    return client.chat.completions.create(model="tiny", messages=USER, **kwargs)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url) as response:
        return json.loads(response.read())


def test_chat_completion_shape_and_usage_match_the_record(client, records):
    response = _chat(client, seed=1)
    assert response.object == "chat.completion" and response.model == "tiny"
    (choice,) = response.choices
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    record = records.get(response.id)
    (kept,) = record.choices
    prompt = TOKENIZER.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert list(kept.prompt_token_ids) == TOKENIZER.encode(prompt, add_special_tokens=False)
    assert response.usage.prompt_tokens == len(kept.prompt_token_ids)
    assert response.usage.completion_tokens == len(kept.token_ids) <= 24
    assert response.usage.total_tokens == len(kept.prompt_token_ids) + len(kept.token_ids)
    assert len(kept.logprobs) == len(kept.token_ids) and kept.finish_reason == choice.finish_reason
    visible = list(kept.token_ids)[:-1] if choice.finish_reason == "stop" else kept.token_ids
    assert choice.message.content == TOKENIZER.decode(visible, skip_special_tokens=True)


def test_same_seed_same_text_and_n_gives_that_many_choices(client, records):
    first, again = _chat(client, seed=7), _chat(client, seed=7)
    assert first.choices[0].message.content == again.choices[0].message.content
    two = _chat(client, seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == first.choices[0].message.content  # choice 0: seed
    kept = records.get(two.id).choices
    assert list(kept[0].token_ids) != list(kept[1].token_ids)  # the other choice samples anew
    assert two.usage.completion_tokens == len(kept[0].token_ids) + len(kept[1].token_ids)
    assert two.usage.prompt_tokens == 2 * len(kept[0].prompt_token_ids)


def test_chat_stream_reassembles_to_the_unstreamed_text(client):
    plain = _chat(client, seed=3, n=2)
    stream = _chat(client, seed=3, n=2, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in plain.choices}
    assert finishes == {c.index: c.finish_reason for c in plain.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_stream_is_server_sent_events_ending_with_done(tiny_server):
    body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 5, "stream": True})
    request = urllib.request.Request(tiny_server.url + "/v1/completions", body.encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_chat_logprobs_one_per_generated_token_equal_to_the_record(client, records):
    response = _chat(client, seed=5, logprobs=True, top_logprobs=0)
    entries = response.choices[0].logprobs.content
    kept = records.get(response.id).choices[0]
    assert len(entries) == response.usage.completion_tokens == len(kept.token_ids)
    assert [e.logprob for e in entries] == list(kept.logprobs)
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in entries)
    streamed = _chat(client, seed=5, logprobs=True, stream=True)
    lps = [e.logprob for c in streamed for ch in c.choices if ch.logprobs
           for e in ch.logprobs.content]  # fmt: skip
    assert lps == list(kept.logprobs)


def test_completions_with_a_string_and_a_token_id_prompt(client, records):
    text = client.completions.create(model="tiny", prompt="12+34=", max_tokens=8, seed=2)
    assert text.object == "text_completion" and isinstance(text.choices[0].text, str)
    kept = records.get(text.id).choices[0]
    assert list(kept.prompt_token_ids) == TOKENIZER.encode("12+34=")
    assert text.usage.completion_tokens == len(kept.token_ids) <= 8
    ids = TOKENIZER.encode("12+34=")
    same = client.completions.create(model="tiny", prompt=ids, max_tokens=8, seed=2)
    assert same.choices[0].text == text.choices[0].text
    assert list(records.get(same.id).choices[0].prompt_token_ids) == ids
    listed = client.completions.create(model="tiny", prompt=[ids], max_tokens=8, seed=2)
    assert listed.choices[0].text == text.choices[0].text


def test_completions_logprobs_in_the_openai_shape(client, records):
    response = client.completions.create(model="tiny", prompt="abc", max_tokens=12, seed=4,
                                         logprobs=1)  # fmt: skip
    choice = response.choices[0]
    kept = records.get(response.id).choices[0]
    lp = choice.logprobs
    count = len(kept.token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == count
    assert lp.token_logprobs == list(kept.logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(0 <= offset <= len(choice.text) for offset in lp.text_offset)


def test_completions_stream_reassembles(client):
    plain = client.completions.create(model="tiny", prompt="xyz", max_tokens=16, seed=6)
    stream = client.completions.create(model="tiny", prompt="xyz", max_tokens=16, seed=6,
                                       stream=True)  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_stop_strings_trim_the_text(client, records):
    def complete(**kwargs):
        return client.completions.create(model="tiny", prompt="hello", max_tokens=40, seed=11,
                                         **kwargs)  # fmt: skip

    full = complete().choices[0].text
    assert len(full) >= 6, full
    one = full[4]  # one character: one token, which the engine stops on itself
    cut = complete(stop=one)
    assert cut.choices[0].text == full[: full.index(one)]
    assert cut.choices[0].finish_reason == "stop"
    two = full[2:4]  # two characters: cut from the text
    both = complete(stop=["\u2603\u2603", two])
    assert both.choices[0].text == full[: full.index(two)]
    assert both.choices[0].finish_reason == "stop"
    kept = records.get(both.id).choices[0]  # the tokens through the stop string's last one
    assert TOKENIZER.decode(kept.token_ids, skip_special_tokens=True).endswith(two)
    assert both.usage.completion_tokens == len(kept.token_ids)
    chat = _chat(client, seed=11, max_tokens=40)
    text = chat.choices[0].message.content
    stopped = _chat(client, seed=11, max_tokens=40, stop=[text[3:5]])
    assert stopped.choices[0].message.content == text[: text.index(text[3:5])]


def test_models_health_and_the_records_route(tiny_server, client, records):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert _get(tiny_server.url + "/health") == {"status": "ok"}
    assert _get(tiny_server.url + "/v1/models/tiny")["max_model_len"] == MAX_SEQ_LEN
    response = _chat(client, seed=9, max_tokens=4)
    record = _get(f"{tiny_server.url}/v1/hybridflow/requests/{response.id}")
    assert record == records.get(response.id).to_dict()
    assert record["endpoint"] == "chat.completions" and record["sampling"]["seed"] == 9
    listed = _get(tiny_server.url + "/v1/hybridflow/requests")["data"]
    assert listed[-1]["id"] == response.id


def test_concurrent_requests_share_decode_steps_and_sample_as_alone(client, engine_client):
    conversations = [[{"role": "user", "content": "q" * (1 + 7 * k)}] for k in range(6)]

    def ask(k):
        return client.chat.completions.create(model="tiny", messages=conversations[k],
                                              max_tokens=16, seed=100 + k)  # fmt: skip

    alone = [ask(k).choices[0].message.content for k in range(6)]
    scheduler = engine_client.engine.scheduler
    steps, rows = scheduler.decode_steps, scheduler.decoded_rows
    start = threading.Barrier(6)

    def together(k):
        start.wait()
        return ask(k).choices[0].message.content

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(together, range(6))) == alone
    # they decoded side by side: more than one row per step on average
    assert (scheduler.decoded_rows - rows) / (scheduler.decode_steps - steps) > 1.5
