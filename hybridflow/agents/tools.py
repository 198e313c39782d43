"""Tools a model may call during an episode, and loading them by name (what a tool is:
tool_protocol.py).

A tool is any object with `name`, `description`, `parameters` (a JSON schema of its
arguments) and `async __call__(arguments) -> str`. Built-in ones are named by a word
("python", "calculator"); a user's is a function in a file, `path/to/file.py:function`,
wrapped in a `FunctionTool` whose schema comes from the function's signature and docstring.

A tool's failure the model should hear about (a bad argument, a failed lookup) is a
`ToolError`: its message is the model's information, not a bug report.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.agents.tool_protocol import Tool, ToolError, check_arguments
from hybridflow.agents.tool_protocol import openai_schema as openai_schema  # re-exported

if TYPE_CHECKING:
    from hybridflow.agents.sandbox import SandboxLimits

BUILTIN_TOOLS = ("python", "calculator")


class ToolLoadError(ValueError):
    """A tool spec cannot be loaded; the message names the spec, file and function."""


_SIMPLE_TYPES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    tuple: "array",
    set: "array",
    dict: "object",
    type(None): "null",
}


def json_schema_of(annotation: Any) -> dict:
    """JSON schema of a type hint: str/int/float/bool/list/dict, `list[int]`, `X | None`,
    `Literal[...]`; anything else gives `{}` (any value)."""
    if annotation in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        schema: dict = {"enum": list(args)}
        kinds = {_SIMPLE_TYPES.get(type(arg)) for arg in args}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    if origin in (typing.Union, types.UnionType):
        schemas = [json_schema_of(arg) for arg in args]
        kinds = [s.get("type") for s in schemas]
        if all(isinstance(kind, str) for kind in kinds) and len(schemas) > 1:
            merged = {"type": kinds}
            others = [s for s in schemas if set(s) - {"type"}]
            if len(others) == 1:  # list[int] | None keeps its "items"
                merged = {**others[0], "type": kinds}
            return merged
        return {}
    if origin in (list, tuple, set, frozenset):
        schema = {"type": "array"}
        if args and origin is not tuple:
            items = json_schema_of(args[0])
            if items:
                schema["items"] = items
        return schema
    if origin is dict:
        return {"type": "object"}
    return {}


_ARGS_HEADER = re.compile(r"^(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph on one line, {argument: description}) of a Google-style docstring."""
    lines = doc.splitlines()
    paragraph: list[str] = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line.strip()):
            break
        paragraph.append(line.strip())
    described: dict[str, str] = {}
    in_args, current, indent = False, None, None
    for line in lines:
        stripped = line.strip()
        if _ARGS_HEADER.match(stripped) and line == line.lstrip():
            in_args, current, indent = True, None, None
            continue
        if not in_args:
            continue
        if stripped and line == line.lstrip():
            break  # the next section
        if not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        entry = _ARG_LINE.match(stripped) if depth == indent else None
        if entry:
            current = entry.group(1).lstrip("*")
            described[current] = entry.group(2).strip()
        elif current is not None:
            described[current] = f"{described[current]} {stripped}".strip()
    return " ".join(paragraph), described


class FunctionTool:
    """A Python function as a tool: the schema is inferred from its signature and docstring.

    Parameters without defaults are required; type hints give the JSON types; a
    Google-style "Args:" section gives each parameter's description. Sync functions run
    in a thread (`asyncio.to_thread`) so a slow one does not stall the other episodes.
    An exception other than ToolError is passed on to the model as a ToolError naming
    its type, since in an episode it is information about the call, not a crash.
    """

    def __init__(
        self,
        fn: Callable,
        name: str | None = None,
        description: str | None = None,
        parameters: dict | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"FunctionTool needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", None)
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"{fn!r} has no __name__: pass FunctionTool(fn, name=...)")
        summary, described = _docstring_parts(inspect.getdoc(fn) or "")
        self.description = summary if description is None else description
        self.parameters = self._infer(described) if parameters is None else parameters
        # An object with `async def __call__` is not a coroutine function itself.
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__
        )

    def _infer(self, described: dict[str, str]) -> dict:
        signature = inspect.signature(self.fn)
        try:
            hints = typing.get_type_hints(self.fn)
        except Exception:  # a hint naming something not importable: use the raw annotations
            hints = {}
        properties: dict[str, dict] = {}
        required: list[str] = []
        schema: dict = {"type": "object", "properties": properties, "required": required}
        for parameter in signature.parameters.values():
            if parameter.kind is parameter.VAR_POSITIONAL:
                continue  # a JSON object has no positional values
            if parameter.kind is parameter.VAR_KEYWORD:
                schema["additionalProperties"] = True
                continue
            if parameter.kind is parameter.POSITIONAL_ONLY:
                raise ValueError(
                    f"tool {self.name!r}: parameter {parameter.name!r} is positional-only; "
                    f"tools are called with named arguments"
                )
            annotation = hints.get(parameter.name, parameter.annotation)
            prop = {} if annotation is parameter.empty else json_schema_of(annotation)
            if parameter.name in described:
                prop["description"] = described[parameter.name]
            properties[parameter.name] = prop
            if parameter.default is parameter.empty:
                required.append(parameter.name)
        return schema

    async def __call__(self, arguments: dict) -> str:
        check_arguments(self.name, self.parameters, arguments)
        try:
            if self._is_async:
                result = await self.fn(**arguments)
            else:
                result = await asyncio.to_thread(self.fn, **arguments)
                if inspect.isawaitable(result):
                    result = await result
        except ToolError:
            raise
        except Exception as error:
            raise ToolError(f"{type(error).__name__}: {error}") from error
        if isinstance(result, (dict, list)):
            return json.dumps(result, ensure_ascii=False, default=str)
        return str(result)

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r})"


def _load_module(spec: str, location: str, what: str = "tool"):
    if not (location.endswith(".py") or "/" in location or "\\" in location):
        try:
            return importlib.import_module(location)
        except Exception as error:
            raise ToolLoadError(
                f"{what} {spec!r}: importing module {location!r} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
    path = Path(location).expanduser().resolve()
    if not path.is_file():
        raise ToolLoadError(f"{what} {spec!r}: file {location!r} does not exist")
    # One module name per absolute path, so two files named tools.py do not collide.
    module_name = f"hybridflow_user_tools_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        where = f" (line {error.lineno})" if isinstance(error, SyntaxError) else ""
        raise ToolLoadError(
            f"{what} {spec!r}: importing {path} failed{where}: {type(error).__name__}: {error}"
        ) from error
    sys.modules[module_name] = module
    return module


def _load_function_tool(spec: str) -> Tool:
    location, _, function_name = spec.rpartition(":")
    if not location or not function_name:
        raise ToolLoadError(
            f"unknown tool {spec!r}: use one of {', '.join(BUILTIN_TOOLS)} "
            f"or path/to/file.py:function"
        )
    module = _load_module(spec, location)
    if not hasattr(module, function_name):
        defined = sorted(
            name
            for name, value in vars(module).items()
            if inspect.isfunction(value) and not name.startswith("_")
        )
        raise ToolLoadError(
            f"tool {spec!r}: {location} has no function {function_name!r}; "
            f"functions defined there: {defined}"
        )
    value = getattr(module, function_name)
    if isinstance(value, Tool) and not inspect.isroutine(value) and not isinstance(value, type):
        return value  # an object that already is a tool (name, schema, async __call__)
    if not callable(value):
        raise ToolLoadError(
            f"tool {spec!r}: {function_name!r} in {location} is a "
            f"{type(value).__name__}, not a function"
        )
    try:
        return FunctionTool(value)
    except (ValueError, TypeError) as error:
        raise ToolLoadError(f"tool {spec!r}: {error}") from error


def load_tool(spec: str, *, sandbox: SandboxLimits | None = None) -> Tool:
    """A tool by spec: `python` (the sandboxed interpreter, with `sandbox` limits),
    `calculator`, or a function: `path/to/file.py:function`, `package.module:function`."""
    spec = spec.strip()
    if spec == "python":
        from hybridflow.agents.sandbox import PythonTool, Sandbox, SandboxLimits

        return PythonTool(Sandbox(sandbox or SandboxLimits()))
    if spec == "calculator":
        from hybridflow.agents.calculator import CalculatorTool

        return CalculatorTool()
    return _load_function_tool(spec)


def load_tools(specs: list[str], *, sandbox: SandboxLimits | None = None) -> dict[str, Tool]:
    """name -> tool for each spec; two tools with one name are an error (the model could
    not tell them apart)."""
    tools: dict[str, Tool] = {}
    origin: dict[str, str] = {}
    for spec in specs:
        tool = load_tool(spec, sandbox=sandbox)
        if tool.name in tools:
            raise ToolLoadError(
                f"tools {origin[tool.name]!r} and {spec!r} are both named {tool.name!r}; "
                f"rename one of them"
            )
        tools[tool.name] = tool
        origin[tool.name] = spec
    return tools
