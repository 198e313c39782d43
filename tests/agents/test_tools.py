"""Tools: schemas inferred from functions, argument checks, sync and async calls, and
loading tools by spec with errors that name the file and function."""

import asyncio
import textwrap
import threading
from typing import Literal

import pytest

from hybridflow.agents.tools import (
    FunctionTool,
    Tool,
    ToolError,
    ToolLoadError,
    check_arguments,
    json_schema_of,
    load_tool,
    load_tools,
    openai_schema,
)


def search(query: str, limit: int = 5, exact: bool = False, scale: float | None = None) -> list:
    """Search the notes for a query.

    Longer explanation that is not part of the description.

    Args:
        query: Words to look for.
        limit: How many results
            to return at most.
        exact (bool): Match whole words only.
    """
    return [query] * limit


async def lookup(key: str) -> dict:
    """Look a key up."""
    await asyncio.sleep(0)
    return {"key": key, "thread": threading.current_thread().name}


def call(tool: Tool, arguments: dict) -> str:
    return asyncio.run(tool(arguments))


def test_schema_is_inferred_from_signature_and_docstring():
    tool = FunctionTool(search)
    assert isinstance(tool, Tool)
    assert tool.name == "search"
    assert tool.description == "Search the notes for a query."
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "Words to look for."},
            "limit": {"type": "integer", "description": "How many results to return at most."},
            "exact": {"type": "boolean", "description": "Match whole words only."},
            "scale": {"type": ["number", "null"]},
        },
        "required": ["query"],
    }
    assert openai_schema(tool) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes for a query.",
            "parameters": tool.parameters,
        },
    }


def test_given_name_description_and_parameters_win():
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    tool = FunctionTool(lambda q: q.upper(), name="shout", description="Shout.", parameters=schema)
    assert (tool.name, tool.description, tool.parameters) == ("shout", "Shout.", schema)
    assert call(tool, {"q": "hi"}) == "HI"


@pytest.mark.parametrize(
    "annotation, schema",
    [
        (str, {"type": "string"}),
        (dict, {"type": "object"}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (dict[str, int], {"type": "object"}),
        (Literal["a", "b"], {"enum": ["a", "b"], "type": "string"}),
        (int | None, {"type": ["integer", "null"]}),
        (object, {}),
    ],
)
def test_json_schema_of(annotation, schema):
    assert json_schema_of(annotation) == schema


def test_sync_functions_run_in_a_thread_and_results_are_text():
    def where() -> str:
        return threading.current_thread().name

    assert call(FunctionTool(where), {}) != threading.current_thread().name
    assert call(FunctionTool(search), {"query": "x", "limit": 2}) == '["x", "x"]'
    assert call(FunctionTool(lambda: 42, name="answer"), {}) == "42"


def test_async_functions_are_awaited_on_the_loop():
    result = call(FunctionTool(lookup), {"key": "k"})
    assert result == '{"key": "k", "thread": "MainThread"}'


def test_argument_errors_name_the_arguments():
    tool = FunctionTool(search)
    with pytest.raises(ToolError, match="missing required argument.*query"):
        call(tool, {"limit": 3})
    with pytest.raises(ToolError, match="unknown argument.*colour.*takes: query, limit"):
        call(tool, {"query": "x", "colour": "red"})
    with pytest.raises(ToolError, match="'limit' of 'search' must be integer, got str"):
        call(tool, {"query": "x", "limit": "3"})
    with pytest.raises(ToolError, match="must be a JSON object"):
        call(tool, ["x"])


def test_kwargs_functions_accept_other_arguments():
    def anything(**kwargs) -> str:
        return ",".join(sorted(kwargs))

    assert call(FunctionTool(anything), {"b": 1, "a": 2}) == "a,b"


def test_integer_is_not_boolean_and_number_takes_ints():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}}
    check_arguments("t", schema, {"n": 1, "x": 2})
    with pytest.raises(ToolError, match="must be integer, got bool"):
        check_arguments("t", schema, {"n": True})


def test_a_function_raising_tells_the_model_why():
    def fails(x: int) -> int:
        return 1 // x

    with pytest.raises(ToolError, match="ZeroDivisionError: integer division or modulo by zero"):
        call(FunctionTool(fails), {"x": 0})


def test_positional_only_parameters_are_refused():
    def positional(x, /):
        return x

    with pytest.raises(ValueError, match="positional-only"):
        FunctionTool(positional)


USER_TOOLS = textwrap.dedent(
    '''
    def word_count(text: str) -> int:
        """Count the words in a text."""
        return len(text.split())

    async def echo(text: str) -> str:
        """Say it back."""
        return text

    NOT_A_FUNCTION = 3
    '''
)


@pytest.fixture()
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    return path


def test_load_tool_from_a_file(tools_file):
    tool = load_tool(f"{tools_file}:word_count")
    assert tool.name == "word_count" and tool.description == "Count the words in a text."
    assert call(tool, {"text": "one two three"}) == "3"
    assert call(load_tool(f"{tools_file}:echo"), {"text": "hi"}) == "hi"


def test_load_builtin_tools():
    tools = load_tools(["calculator", "python"])
    assert sorted(tools) == ["calculator", "python"]
    assert call(tools["calculator"], {"expression": "6*7"}) == "42"


def test_load_python_with_limits():
    from hybridflow.agents.sandbox import SandboxLimits

    tool = load_tool("python", sandbox=SandboxLimits(timeout_s=3))
    assert tool.sandbox.limits.timeout_s == 3


def test_missing_file(tmp_path):
    with pytest.raises(ToolLoadError, match="nope.py' does not exist"):
        load_tool(f"{tmp_path / 'nope.py'}:f")


def test_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def f(:\n    pass\n")
    with pytest.raises(
        ToolLoadError, match=r"importing .*broken.py failed \(line 1\): SyntaxError"
    ):
        load_tool(f"{bad}:f")


def test_import_error_in_the_file(tmp_path):
    bad = tmp_path / "needs.py"
    bad.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(ToolLoadError, match="needs.py failed: ModuleNotFoundError"):
        load_tool(f"{bad}:f")


def test_missing_function_lists_the_defined_ones(tools_file):
    with pytest.raises(ToolLoadError, match=r"no function 'count'.*\['echo', 'word_count'\]"):
        load_tool(f"{tools_file}:count")


def test_not_callable(tools_file):
    with pytest.raises(ToolLoadError, match="'NOT_A_FUNCTION' .* is a int, not a function"):
        load_tool(f"{tools_file}:NOT_A_FUNCTION")


def test_unknown_spec():
    with pytest.raises(ToolLoadError, match="unknown tool 'browser'.*python, calculator"):
        load_tool("browser")


def test_module_spec():
    tool = load_tool("hybridflow.rewards.scorers.gsm8k:clean_number")
    assert tool.name == "clean_number"
    assert call(tool, {"text": "1,000"}) == "1000"


def test_duplicate_names(tools_file, tmp_path):
    other = tmp_path / "other.py"
    other.write_text("def word_count(text: str) -> int:\n    return 0\n")
    with pytest.raises(ToolLoadError, match="both named 'word_count'"):
        load_tools([f"{tools_file}:word_count", f"{other}:word_count"])
    with pytest.raises(ToolLoadError, match="both named 'calculator'"):
        load_tools(["calculator", "calculator"])
