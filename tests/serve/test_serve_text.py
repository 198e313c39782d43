"""Token ids -> text (incremental pieces, split characters, stop strings) and the chat
message conversion, without a server."""

from __future__ import annotations

import pytest
from serve_helpers import TOKENIZER

from hybridflow.serve.openai_protocol import RequestError, convert_messages, parse_chat_request
from hybridflow.serve.text import finish_output, token_pieces

EOS = TOKENIZER.eos_token_id


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_pieces_join_to_the_text_and_skip_special_tokens():
    ids = _ids("ab c") + [3] + _ids("d")  # 3: <|im_start|>
    assert token_pieces(TOKENIZER, ids) == ["a", "b", " ", "c", "", "d"]
    assert token_pieces(TOKENIZER, ids, skip_special_tokens=False)[4] == "<|im_start|>"


def test_split_characters_come_out_on_their_last_byte_token():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = tokenizer.encode("a\u00e9\u20acb", add_special_tokens=False)  # 1 + 2 + 3 + 1 bytes
    assert token_pieces(tokenizer, ids) == ["a", "", "\u00e9", "", "", "\u20ac", "b"]
    assert token_pieces(tokenizer, ids[:4])[-1] == "\ufffd"  # cut inside a character


def test_engine_stop_token_is_kept_in_the_ids_and_left_out_of_the_text():
    ids = _ids("hi") + [EOS]
    out = finish_output(TOKENIZER, ids, [-1.0, -2.0, -3.0], "stop", [],
                        skip_special_tokens=False)  # fmt: skip
    assert out.text == "hi" and out.token_ids == ids and out.finish_reason == "stop"
    assert out.pieces == ["h", "i", ""] and out.logprobs == [-1.0, -2.0, -3.0]


def test_the_stop_string_completed_first_cuts_text_and_tokens():
    ids = _ids("xxabcdyy")
    out = finish_output(TOKENIZER, ids, list(range(len(ids))), "length", ["abcd", "bc"])
    assert out.text == "xxa" and out.finish_reason == "stop"  # "bc" ends before "abcd"
    assert out.token_ids == _ids("xxabc") and out.logprobs == [0, 1, 2, 3, 4]
    assert "".join(out.pieces) == out.text and out.offsets == [0, 1, 2, 3, 3]
    assert finish_output(TOKENIZER, ids, [0.0] * 8, "length", ["zz"]).text == "xxabcdyy"


def test_assistant_tool_calls_become_hermes_text_and_roles_are_checked():
    messages = convert_messages([
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ])  # fmt: skip
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1] == {"role": "assistant",
                           "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'}  # fmt: skip
    assert messages[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    with pytest.raises(RequestError) as error:
        convert_messages([{"role": "function", "content": "x"}])
    assert error.value.param == "messages[0].role"


def test_chat_fields_and_defaults():
    request = parse_chat_request({"messages": [{"role": "user", "content": "q"}],
                                  "max_completion_tokens": 9, "max_tokens": 3, "seed": -1})  # fmt: skip
    assert request.sampling.max_tokens == 9 and request.sampling.seed == 2**62 - 1
    assert request.sampling.choice_seed(0) == request.sampling.seed
    assert request.sampling.choice_seed(1) != request.sampling.seed + 1
    assert not request.parse_tool_calls and request.sampling.temperature == 1.0
