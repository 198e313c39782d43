"""Tool calls parsed from generated text. The default format is Hermes / Qwen's:

    I will compute it.<tool_call>
    {"name": "calculator", "arguments": {"expression": "12345 * 6789"}}
    </tool_call>

A parser returns the text outside the calls, the calls, and one error per call it could not
read (malformed JSON, a missing name, an unclosed tag): the loop answers each error to the
model as a tool result instead of stopping the episode. Parsers are pluggable (ToolCallParser).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = ""


@dataclass
class ParsedTurn:
    content: str
    """The generated text with the tool calls taken out (stripped)."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One message per call that could not be read, for the model."""


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number per turn;
    `arguments` may also be a JSON string holding the object (some models write that)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self):
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag),
                                 re.DOTALL)  # fmt: skip

    def parse(self, text: str) -> ParsedTurn:
        calls, errors, outside = [], [], []
        position = 0
        for index, match in enumerate(self._block.finditer(text)):
            outside.append(text[position : match.start()])
            position = match.end()
            call, error = self._read(match.group(1), index)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        rest = text[position:]
        if self.open_tag in rest:  # opened and never closed: the turn was cut off
            head, _, tail = rest.partition(self.open_tag)
            outside.append(head)
            errors.append(f"tool call #{len(calls) + len(errors) + 1} was not closed with "
                          f"{self.close_tag}: {tail.strip()[:80]!r}")  # fmt: skip
        else:
            outside.append(rest)
        return ParsedTurn("".join(outside).strip(), calls, errors)

    @staticmethod
    def _read(body: str, index: int) -> tuple[ToolCall | None, str]:
        where = f"tool call #{index + 1}"
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError as error:
            return None, f"{where} is not valid JSON ({error.msg} at char {error.pos})"
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None, f'{where} must be a JSON object with a "name" string'
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return None, f'{where}: "arguments" is a string that is not a JSON object'
        if not isinstance(arguments, dict):
            return None, f'{where}: "arguments" must be a JSON object'
        return ToolCall(data["name"], arguments, id=f"call_{index}"), ""


PARSERS = {"hermes": HermesParser}


def make_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name]()
