"""The calculator: exact big integers, Python precedence, and clear errors for what it
refuses (names, calls, huge results, division by zero)."""

import asyncio

import pytest

from hybridflow.agents.calculator import (
    MAX_EXPRESSION_CHARS,
    CalculatorTool,
    evaluate,
    format_number,
)
from hybridflow.agents.tools import Tool, ToolError, openai_schema


def calc(expression: str) -> str:
    return asyncio.run(CalculatorTool()({"expression": expression}))


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("2**200", str(2**200)),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("-2**2", "-4"),  # ** binds tighter than unary minus
        ("2**-1", "0.5"),
        ("2**3**2", "512"),  # right-associative
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("7 / 2", "3.5"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("1_000 * 3", "3000"),
        ("10**100 + 1 - 10**100", "1"),
        ("+5", "5"),
    ],
)
def test_values(expression, expected):
    assert calc(expression) == expected


def test_results_longer_than_int_str_limit_print_exactly():
    value = 7**10_000  # 8,451 digits: more than str() prints by default
    text = calc("7**10000")
    assert len(text) == 8451
    assert int(text[:100]) == value // 10 ** (8451 - 100)
    assert format_number(-(10**5000)) == "-1" + "0" * 5000


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("x + 1", "names such as 'x' are not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("9**9**9", "more than 10000 digits"),
        ("10**5000 * 10**5001", "more than 10000 digits"),
        ("2**10**6", "more than 10000 digits"),
        ("2 ^ 10", "use \\*\\*"),
        ("'a' * 3", "not a number"),
        ("(-8) ** 0.5", "complex"),
        ("1e308 * 10", "too large for a float"),
        ("10**400 * 1.5", "too large for a float"),
        ("2 +", "not an arithmetic expression"),
        ("", "empty"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1 << 10", "LShift is not allowed"),
    ],
)
def test_errors(expression, message):
    with pytest.raises(ToolError, match=message):
        calc(expression)


def test_expression_length_limit():
    with pytest.raises(ToolError, match=f"at most {MAX_EXPRESSION_CHARS}"):
        evaluate("1+" * 600 + "1")


def test_deep_nesting_is_refused_not_crashing():
    with pytest.raises(ToolError):
        evaluate("(" * 400 + "1" + ")" * 400)
    with pytest.raises(ToolError):
        evaluate("-" * 999 + "1")


def test_tool_schema_and_arguments():
    tool = CalculatorTool()
    assert isinstance(tool, Tool)
    schema = openai_schema(tool)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ToolError, match="missing required argument"):
        asyncio.run(tool({}))
    with pytest.raises(ToolError, match="must be string"):
        asyncio.run(tool({"expression": 12}))


@pytest.mark.parametrize(
    "expression, message",
    [
        ("3if 1 else 2", "'3if' is not a number"),  # Python's parser warns: invalid decimal literal
        ("0x1for", "'0x1for' is not a number"),  # invalid hexadecimal literal
        ("b.5is4", "'.5is4' is not a number"),
        ("'\\d' * 2", "a backslash is not arithmetic"),  # invalid escape sequence
    ],
)
def test_what_pythons_parser_would_warn_about_is_refused_without_a_warning(expression, message):
    # a model writes such things; the parser's SyntaxWarning would land on the run's stderr
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ToolError, match=message):
            calc(expression)
    assert not caught, [str(w.message) for w in caught]


@pytest.mark.parametrize("expression, expected", [("1e+2", "100.0"), ("0x1f + 0b11", "34"),
                                                  ("1_000 * .5", "500.0"), ("3. * 2", "6.0")])  # fmt: skip
def test_number_literals_still_read(expression, expected):
    assert calc(expression) == expected
