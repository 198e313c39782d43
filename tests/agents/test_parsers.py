"""HermesParser: calls amid text, several per turn, malformed and unclosed ones."""

from __future__ import annotations

import pytest

from hybridflow.agents.parsers import HermesParser, ToolCall, make_parser


def test_text_around_a_call_is_kept_as_content():
    turn = HermesParser().parse(
        'Let me check.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n'
        "</tool_call>\nDone."
    )
    assert turn.calls == [ToolCall("calculator", {"expression": "2+2"}, "call_0")]
    assert turn.content == "Let me check.\n\nDone." and turn.errors == []


def test_several_calls_in_one_turn_keep_their_order():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>')  # fmt: skip
    turn = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert turn.content == ""


def test_malformed_calls_become_errors_and_good_ones_still_run():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>'  # a brace missing
            '<tool_call>["not", "an", "object"]</tool_call>'
            '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "c", "arguments": 3}</tool_call>')  # fmt: skip
    turn = HermesParser().parse(text)
    assert [c.name for c in turn.calls] == ["ok"]
    assert len(turn.errors) == 3
    assert "tool call #1 is not valid JSON" in turn.errors[0]
    assert '"name" string' in turn.errors[1] and '"arguments" must be' in turn.errors[2]


def test_an_unclosed_call_is_an_error_and_plain_text_has_no_calls():
    turn = HermesParser().parse('Thinking <tool_call>{"name": "a", "argu')
    assert turn.calls == [] and "not closed" in turn.errors[0] and turn.content == "Thinking"
    plain = HermesParser().parse("The answer is 4.")
    assert plain.calls == [] and plain.errors == [] and plain.content == "The answer is 4."


def test_parsers_are_chosen_by_name():
    assert isinstance(make_parser("hermes"), HermesParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'"):
        make_parser("xml")
