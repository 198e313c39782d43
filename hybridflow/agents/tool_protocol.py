"""What a tool is to an agent loop: the Tool protocol, the ToolError a model is told about,
the schema shown to the model (OpenAI's function form) and the check of a call's arguments
against it. The built-in tools (calculator.py, sandbox.py) and the loader (tools.py) use it.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tool(Protocol):
    """What an agent loop needs from a tool: a schema to show the model and a coroutine."""

    name: str
    description: str
    parameters: dict
    """JSON schema: {"type": "object", "properties": {...}, "required": [...]}."""

    async def __call__(self, arguments: dict) -> str: ...


class ToolError(Exception):
    """A failure the model caused and can fix; the message is what the model is told."""


def openai_schema(tool: Tool) -> dict:
    """The tool in the form `apply_chat_template(tools=...)` and the OpenAI API take."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def _matches(value: Any, json_type: str) -> bool:
    if json_type not in _JSON_TYPES:
        return True  # a type this check does not know: leave it to the tool
    if isinstance(value, bool) and json_type in ("integer", "number"):
        return False  # True is an int in Python, not a number in JSON
    return isinstance(value, _JSON_TYPES[json_type])


def check_arguments(tool_name: str, schema: dict, arguments: Any) -> None:
    """Raise ToolError for a call the schema rejects: not an object, a required name
    missing, a name the schema does not list (unless `additionalProperties` allows it),
    or a top-level value of the wrong JSON type."""
    if not isinstance(arguments, dict):
        raise ToolError(
            f"the arguments of {tool_name!r} must be a JSON object, got {type(arguments).__name__}"
        )
    properties: dict = schema.get("properties") or {}
    missing = [name for name in schema.get("required") or [] if name not in arguments]
    if missing:
        raise ToolError(f"{tool_name!r} is missing required argument(s): {', '.join(missing)}")
    if not schema.get("additionalProperties", False):
        unknown = [name for name in arguments if name not in properties]
        if unknown:
            takes = ", ".join(properties) or "no arguments"
            raise ToolError(
                f"{tool_name!r} got unknown argument(s): {', '.join(unknown)}; it takes: {takes}"
            )
    for name, value in arguments.items():
        declared = (properties.get(name) or {}).get("type")
        if declared is None:
            continue
        allowed = declared if isinstance(declared, list) else [declared]
        if not any(_matches(value, json_type) for json_type in allowed):
            raise ToolError(
                f"argument {name!r} of {tool_name!r} must be {' or '.join(allowed)}, "
                f"got {type(value).__name__} {json.dumps(value, default=str)[:80]}"
            )
