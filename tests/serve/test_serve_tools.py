"""Tool calls through the API, with a scripted generation client in place of the engine (a
random model never calls a tool): the client gets parsed `tool_calls`, and the tool result
sent back renders into the next prompt. Also: generation failures are a JSON 500, and the
records are bounded, and tools a chat template cannot render are refused."""

from __future__ import annotations

import json

import openai
import pytest
from serve_helpers import EOS, TOKENIZER

from hybridflow.models.tokenizer import build_char_tokenizer
from hybridflow.serve.app import RECORDS

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}}]  # fmt: skip
USER = {"role": "user", "content": "Weather in Paris?"}


def test_tool_call_round_trip(scripted):
    api, fake, app = scripted([f"Let me look.{CALL}", "It is sunny in Paris."])
    first = api.chat.completions.create(model="scripted", messages=[USER], tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id
    assert choice.message.content == "Let me look."
    prompt = TOKENIZER.decode(fake.prompts[0])
    assert '"name": "get_weather"' in prompt  # the tools rendered by the template

    messages = [USER, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]  # fmt: skip
    second = api.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
    prompt = TOKENIZER.decode(fake.prompts[1])
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt
    assert f"<|im_start|>assistant\nLet me look.\n{CALL}<|im_end|>" in prompt
    kept = app[RECORDS].get(second.id).choices[0]
    assert list(kept.prompt_token_ids) == fake.prompts[1] and kept.finish_reason == "stop"


def test_tool_calls_stream_and_tool_choice_none(scripted):
    api, fake, _ = scripted([CALL])
    stream = api.chat.completions.create(model="scripted", messages=[USER], tools=TOOLS,
                                         stream=True)  # fmt: skip
    deltas = [c.choices[0] for c in stream]
    calls = [tc for d in deltas if d.delta.tool_calls for tc in d.delta.tool_calls]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert deltas[-1].finish_reason == "tool_calls"
    plain = api.chat.completions.create(model="scripted", messages=[USER], tools=TOOLS,
                                        tool_choice="none")  # fmt: skip
    assert plain.choices[0].message.content == CALL and plain.choices[0].finish_reason == "stop"
    untooled = api.chat.completions.create(model="scripted", messages=[USER])
    assert untooled.choices[0].message.tool_calls is None


def test_tools_the_template_cannot_render_are_refused_not_dropped(scripted):
    plain = build_char_tokenizer()  # its template has no place for tools
    api, fake, _ = scripted(["fine"], tokenizer=plain)
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(model="scripted", messages=[USER], tools=TOOLS)
    body = error.value.body
    assert body["code"] == "tools_not_supported" and body["param"] == "tools"
    assert "--chat-template" in body["message"]
    assert fake.prompts == []  # nothing generated
    answer = api.chat.completions.create(model="scripted", messages=[USER])  # no tools: served
    assert answer.choices[0].message.content == "fine"


def test_generation_failure_is_a_json_500_and_the_server_keeps_serving(scripted):
    api, _, _ = scripted([RuntimeError("device lost"), "fine"])
    with pytest.raises(openai.InternalServerError) as error:
        api.chat.completions.create(model="scripted", messages=[USER])
    assert error.value.status_code == 500
    assert "device lost" in error.value.body["message"] and "Traceback" not in str(error.value)
    assert error.value.body["type"] == "server_error"
    assert (
        api.chat.completions.create(model="scripted", messages=[USER]).choices[0].message.content
        == "fine"
    )


def test_records_keep_the_last_n(scripted):
    api, _, app = scripted(["a"], max_records=2)
    ids = [api.completions.create(model="scripted", prompt="x").id for _ in range(3)]
    records = app[RECORDS]
    assert records.ids() == ids[1:] and ids[0] not in records
    assert list(records.get(ids[2]).choices[0].token_ids) == TOKENIZER.encode("a") + [EOS]
