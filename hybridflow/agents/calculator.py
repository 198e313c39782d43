"""A calculator tool: arithmetic on exact integers and floats, parsed with `ast`, never eval'd.

Only numbers, + - * / // % **, unary signs and parentheses are accepted. The bounds below
keep one call cheap whatever the model writes: a 1,000-character expression cannot ask for
a number with millions of digits (`9**9**9`), because every integer result, and every
power and product before it is computed, must fit in `MAX_RESULT_DIGITS` digits.
"""

from __future__ import annotations

import ast
import math
import re

from hybridflow.agents.tool_protocol import ToolError, check_arguments

MAX_EXPRESSION_CHARS = 1_000
MAX_RESULT_DIGITS = 10_000
_MAX_BITS = math.ceil(MAX_RESULT_DIGITS / math.log10(2))  # 2**_MAX_BITS has ~10,000 digits
# str(int) refuses more than sys.get_int_max_str_digits() digits (4,300 by default, at
# least 640); large results are printed in chunks below that.
_CHUNK_DIGITS = 600

_OPERATORS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}
_ALLOWED = "numbers, + - * / // % ** and parentheses"


def _too_large() -> ToolError:
    return ToolError(f"the result would have more than {MAX_RESULT_DIGITS} digits")


def _checked(value: int | float) -> int | float:
    if isinstance(value, complex):
        raise ToolError("the result is a complex number (a negative number to a fractional power)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is too large for a float; use integers for exact results")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise _too_large()
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * (base.bit_length() - 1) > _MAX_BITS:
            raise _too_large()  # refuse before computing it
    return base**exponent


def _apply(op: ast.operator, left: int | float, right: int | float) -> int | float:
    if isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > _MAX_BITS + 1:
            raise _too_large()
    try:
        if isinstance(op, ast.Add):
            return left + right
        if isinstance(op, ast.Sub):
            return left - right
        if isinstance(op, ast.Mult):
            return left * right
        if isinstance(op, ast.Div):
            return left / right
        if isinstance(op, ast.FloorDiv):
            return left // right
        if isinstance(op, ast.Mod):
            return left % right
        return _power(left, right)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError(
            "the result is too large for a float; use // or integers for exact results"
        ) from None


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float):
            return _checked(node.value)
        raise ToolError(f"{node.value!r} is not a number; only {_ALLOWED} are allowed")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.BitXor):
            raise ToolError("'^' is not a power here: use ** (2**10)")
        if type(node.op) not in _OPERATORS:
            raise ToolError(f"operator {type(node.op).__name__} is not allowed; only {_ALLOWED}")
        return _checked(_apply(node.op, _evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.Name):
        raise ToolError(f"names such as {node.id!r} are not allowed; only {_ALLOWED}")
    if isinstance(node, ast.Call):
        raise ToolError(f"function calls are not allowed; only {_ALLOWED}")
    raise ToolError(f"{type(node).__name__} is not allowed in an expression; only {_ALLOWED}")


# Read left to right as Python's tokenizer does: a name whole, else a number's run (a digit,
# or a dot and a digit, then digits, letters, dots, "_" and an exponent's sign), else one
# character. Group 1 is a number's run.
_RUNS = re.compile(r"[^\W\d]\w*|(\.?\d(?:[eE][+-]\d|[\w.])*)|.", re.DOTALL)


def _not_parsed(expression: str) -> str | None:
    """Why ``expression`` is refused before Python's parser sees it, or None. The parser warns
    (a SyntaxWarning on stderr, from whichever thread runs the tool) about a number run into
    a word (``3if``, ``0x1for``) and about escapes in strings (a backslash); neither is
    arithmetic, so both are refused here, where the model is told why."""
    if "\\" in expression:
        return f"a backslash is not arithmetic; only {_ALLOWED}"
    for run in _RUNS.findall(expression):
        if run and not _is_number(run):
            return f"{run!r} is not a number; only {_ALLOWED}"
    return None


def _is_number(text: str) -> bool:
    """``text`` reads as an int (decimal, 0x, 0o, 0b) or a float literal."""
    for read in (lambda t: int(t, 0), float):
        try:
            read(text)
            return True
        except ValueError:
            continue
    return False


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolError says what is wrong with a bad one."""
    if not isinstance(expression, str):
        raise ToolError(f"the expression must be a string, got {type(expression).__name__}")
    expression = expression.strip()
    if not expression:
        raise ToolError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(
            f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}"
        )
    refused = _not_parsed(expression)
    if refused is not None:
        raise ToolError(refused)
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ToolError(f"not an arithmetic expression: {error.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise ToolError("the expression is nested too deeply") from None
    try:
        return _evaluate(tree)
    except RecursionError:
        raise ToolError("the expression is nested too deeply") from None


def format_number(value: int | float) -> str:
    """Exact digits for an int of any size (up to the limit); repr for a float."""
    if isinstance(value, float):
        return repr(value)
    if value < 0:
        return "-" + format_number(-value)
    chunks = []
    while value >= 10**_CHUNK_DIGITS:
        value, chunk = divmod(value, 10**_CHUNK_DIGITS)
        chunks.append(str(chunk).zfill(_CHUNK_DIGITS))
    return str(value) + "".join(reversed(chunks))


class CalculatorTool:
    """The "calculator" tool: one expression in, its value out as text."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression exactly: integers of any size, decimals, "
        "+ - * / // % ** and parentheses (for example 2**200 or (3.5 + 4) * 12 // 5)."
    )
    parameters = {
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                "description": "The expression, using Python operators (** for powers).",
            }
        },
        "required": ["expression"],
    }

    async def __call__(self, arguments: dict) -> str:
        check_arguments(self.name, self.parameters, arguments)
        return format_number(evaluate(arguments["expression"]))

    def __repr__(self) -> str:
        return "CalculatorTool()"
