"""Chat messages as OpenAI's API sends them -> what the chat template renders: each
message's content one string, an assistant's `tool_calls` written into it as Hermes text."""

from __future__ import annotations

import json
from typing import Any

from hybridflow.serve.json_text import lone_surrogate, surrogate_message
from hybridflow.serve.request_error import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles accepted; "developer" (OpenAI's newer name) is rendered as "system"."""


def hermes_tool_calls_text(calls: list[dict], where: str) -> str:
    """An OpenAI assistant `tool_calls` list as Hermes text (Qwen2.5's rendering):
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per line."""
    blocks = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{at} must be {{'type': 'function', 'function': "
                               "{'name': ..., 'arguments': ...}}", at)  # fmt: skip
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                raise RequestError(f"{at}.function.arguments is not JSON ({error.msg})",
                                   f"{at}.function.arguments") from None  # fmt: skip
            surrogate = lone_surrogate(arguments)  # escaped inside the string: decoded only now
            if surrogate is not None:
                where = f"{at}.function.arguments"
                raise RequestError(surrogate_message(where, *surrogate[1:]), where,
                                   "invalid_unicode")  # fmt: skip
        payload = json.dumps({"name": function["name"], "arguments": arguments},
                             ensure_ascii=False)  # fmt: skip
        blocks.append(f"<tool_call>\n{payload}\n</tool_call>")
    return "\n".join(blocks)


def _content(value: Any, where: str, optional: bool) -> str:
    if value is None:
        if optional:
            return ""
        raise RequestError(f"{where}.content is missing", f"{where}.content")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(f"{where}.content[{k}]: only text parts are supported",
                                   f"{where}.content")  # fmt: skip
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(f"{where}.content must be a string or a list of text parts",
                       f"{where}.content")  # fmt: skip


def convert_messages(raw: Any) -> list[dict]:
    """OpenAI chat messages -> what the chat template renders (see ChatRequest.messages)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}",
                               f"{where}.role")  # fmt: skip
        calls = message.get("tool_calls") if role == "assistant" else None
        content = _content(message.get("content"), where, optional=role == "assistant")
        if calls:
            if not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            text = hermes_tool_calls_text(calls, where)
            content = f"{content}\n{text}" if content else text
        converted = {"role": "system" if role == "developer" else role, "content": content}
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                converted[key] = message[key]
        out.append(converted)
    return out
