"""Bad requests get a 4xx with OpenAI's JSON error body (never a traceback, never a 500),
and the server keeps serving afterwards."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import openai
import pytest
from serve_helpers import MAX_SEQ_LEN

USER = [{"role": "user", "content": "hi"}]


def _post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _check_error_body(body: dict) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b"\xff\xfe\x00", b""])
def test_bad_json_is_400(tiny_server, path, data):
    status, body = _post(tiny_server.url + path, data)
    assert status == 400
    assert _check_error_body(body)["type"] == "invalid_request_error"


CHAT_CASES = [
    ({"n": 0}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
    ({"messages": None}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x" * MAX_SEQ_LEN}]}, "messages"),
    ({"stop": ""}, "stop"),
    ({"seed": "one"}, "seed"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),  # fmt: skip
]


@pytest.mark.parametrize("fields, param", CHAT_CASES)
def test_bad_chat_fields_are_400_naming_the_field(tiny_server, fields, param):
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    status, answer = _post(tiny_server.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, answer
    assert _check_error_body(answer)["param"] == param


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "a" * MAX_SEQ_LEN}, "prompt"),
    ({"prompt": [1000]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[5, 6], "ab", 3]}, "prompt[2]"),
    ({"prompt": None}, "prompt"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"n": 1000}, "n"),
])  # fmt: skip
def test_bad_completion_fields_are_400(tiny_server, fields, param):
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 4, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    status, answer = _post(tiny_server.url + "/v1/completions", json.dumps(body).encode())
    assert status == 400, answer
    assert _check_error_body(answer)["param"] == param


NAN, INF = float("nan"), float("inf")  # json.dumps writes NaN and Infinity, as Python reads them


@pytest.mark.parametrize("fields, param", [
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": -INF}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 1e-320}, "temperature"),  # divides the logits to inf: an empty 200 before
    ({"temperature": 1e308}, "temperature"),  # beyond float32: the engine could not store it
    ({"top_p": NAN}, "top_p"),
    ({"top_p": INF}, "top_p"),
    ({"min_p": NAN}, "min_p"),
    ({"presence_penalty": NAN}, "presence_penalty"),
    ({"frequency_penalty": INF}, "frequency_penalty"),
    ({"max_tokens": NAN}, "max_tokens"),
    ({"max_tokens": INF}, "max_tokens"),
    ({"max_completion_tokens": -INF}, "max_completion_tokens"),
    ({"n": NAN}, "n"),
    ({"top_k": INF}, "top_k"),
    ({"seed": NAN}, "seed"),
    ({"top_logprobs": NAN}, "top_logprobs"),
    ({"stop": [str(k) for k in range(17)]}, "stop"),
])  # fmt: skip
def test_non_finite_and_out_of_range_numbers_are_400_naming_the_field(tiny_server, fields, param):
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, **fields}
    status, answer = _post(tiny_server.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, answer
    error = _check_error_body(answer)
    assert error["param"] == param and param in error["message"]


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": NAN}, "logprobs"),
    ({"temperature": NAN}, "temperature"),
    ({"prompt": ["ab"] * 65, "n": 16}, "prompt"),  # 1040 choices, over max_choices (1024)
])  # fmt: skip
def test_completion_numbers_and_choices_are_checked(tiny_server, fields, param):
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 4, **fields}
    status, answer = _post(tiny_server.url + "/v1/completions", json.dumps(body).encode())
    assert status == 400, answer
    assert _check_error_body(answer)["param"] == param


LONE = "a\ud800b"  # json.dumps writes it as the escape \ud800, which json.loads takes back


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "content": "x"},
                                           {"role": "tool", "content": [{"type": "text",
                                                                         "text": LONE}]}]},
     "messages[2].content[0].text"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "description": LONE, "parameters": {}}}]}, "tools[0].function.description"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "tool_calls": [{
        "type": "function", "function": {"name": "f", "arguments": '{"x": "\\ud800"}'}}]}]},
     "messages[1].tool_calls[0].function.arguments"),  # escaped inside the arguments' JSON
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/v1/completions", {"prompt": ["ab", "\udfff"]}, "prompt[1]"),
])  # fmt: skip
def test_a_lone_surrogate_is_400_naming_where(tiny_server, client, path, fields, param):
    body = {"model": "tiny", "messages": USER, "prompt": "ab", "max_tokens": 2, **fields}
    status, answer = _post(tiny_server.url + path, json.dumps(body).encode())
    assert status == 400, answer
    error = _check_error_body(answer)
    assert error["param"] == param and error["code"] == "invalid_unicode", error
    assert "lone UTF-16 surrogate" in error["message"] and param in error["message"]
    assert client.completions.create(model="tiny", prompt="ab", max_tokens=2).choices


def test_smallest_and_largest_temperatures_taken_sample(client):
    for temperature in (1e-6, 1000):
        answer = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=3, temperature=temperature, logprobs=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        logprobs = [t.logprob for t in answer.choices[0].logprobs.content]
        assert len(logprobs) == 3 and all(math.isfinite(lp) and lp <= 0 for lp in logprobs)


def test_too_long_prompt_says_so(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="a" * MAX_SEQ_LEN, max_tokens=2)
    assert error.value.body["code"] == "context_length_exceeded"
    assert str(MAX_SEQ_LEN) in error.value.body["message"]


def test_unknown_model_and_route_are_404_json(tiny_server, client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-9", messages=USER)
    assert error.value.body["code"] == "model_not_found"
    status, body = _post(tiny_server.url + "/v1/nowhere", b"{}")
    assert status == 404 and _check_error_body(body)["code"] == "not_found"
    status, body = _post(tiny_server.url + "/v1/hybridflow/requests/cmpl-none", b"{}")
    assert status == 405 and _check_error_body(body)["code"] == "method_not_allowed"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(tiny_server.url + "/v1/hybridflow/requests/cmpl-none")
    assert missing.value.code == 404
    assert json.loads(missing.value.read())["error"]["code"] == "record_not_found"


def test_server_keeps_serving_after_bad_requests(tiny_server, client):
    for data in (b"{", b'{"messages": 3}', json.dumps({"messages": USER, "n": -1}).encode()):
        assert _post(tiny_server.url + "/v1/chat/completions", data)[0] == 400
    response = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
    assert response.usage.completion_tokens <= 3


def _strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as JSON parsers outside Python do."""

    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_logprobs_are_sent_as_strict_json(scripted):
    api, fake, _ = scripted(["abc"])  # 3 tokens and the eos
    generate = fake.generate

    async def non_finite(prompt_ids, params):  # what a model that overflowed would give
        out = await generate(prompt_ids, params)
        out.logprobs = [math.nan, -math.inf, math.inf, -0.25]
        return out

    fake.generate = non_finite
    url = str(api.base_url).rstrip("/")
    requests = {
        "/completions": {"model": "scripted", "prompt": "hi", "logprobs": 1},
        "/chat/completions": {"model": "scripted", "messages": USER, "logprobs": True},
    }
    for path, body in requests.items():
        for stream in (False, True):
            data = json.dumps({**body, "stream": stream}).encode()
            request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request) as response:
                assert response.status == 200
                text = response.read().decode()
            if not stream:
                choice = _strict_json(text)["choices"][0]["logprobs"]
                sent = choice.get("token_logprobs") or [e["logprob"] for e in choice["content"]]
                assert sent == [
                    None,
                    -9999.0,
                    None,
                    -0.25,
                ]  # NaN and +inf: null; -inf: OpenAI's floor
                record = _strict_json(urllib.request.urlopen(
                    f"{url}/hybridflow/requests/{_strict_json(text)['id']}").read().decode())  # fmt: skip
                assert record["choices"][0]["logprobs"][:3] == [None, None, None]
                continue
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            for event in events[:-1]:
                _strict_json(event)
