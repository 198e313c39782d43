"""SFT data: loss only on response tokens, both row layouts, packing."""

import json

import pytest

from hybridflow.data.schema import DataSchemaError
from hybridflow.data.sft_examples import (
    collate_packed,
    load_sft_rows,
    pack_examples,
    tokenize_sft_rows,
)
from hybridflow.models.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
IM_START, EOS = TOKENIZER.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])


def chars(text):
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_prompt_response_loss_mask(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "1+2="}], "response": "3"}) + "\n"
    )
    (example,), dropped = tokenize_sft_rows(load_sft_rows(path), TOKENIZER, EOS)
    # <|im_start|>u1+2=<|im_end|><|im_start|>a | 3<|im_end|>
    assert example.input_ids == [IM_START, *chars("u1+2="), EOS, IM_START, *chars("a3"), EOS]
    assert example.loss_mask == [0] * 9 + [1, 1]  # the answer and its end-of-turn
    assert dropped == 0


def test_messages_layout_masks_every_assistant_turn():
    messages = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    (example,), _ = tokenize_sft_rows([messages], TOKENIZER, EOS)
    learned = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    assert TOKENIZER.decode(learned, skip_special_tokens=False) == "2<|im_end|>4<|im_end|>"
    assert learned.count(EOS) == 2 and IM_START not in learned
    # the turn opener <|im_start|>a is prompt, not target: ...<|im_start|> a | 4 <|im_end|>
    assert example.loss_mask[-4:] == [0, 0, 1, 1]


def test_rows_over_max_length_are_dropped():
    rows = [
        ([{"role": "user", "content": "1+2="}], "3"),
        ([{"role": "user", "content": "10+20="}], "30"),
    ]
    # lengths: 9 + 2 = 11 and 11 + 3 = 14 tokens; a row exactly at the limit is kept
    examples, dropped = tokenize_sft_rows(rows, TOKENIZER, EOS, max_length=11)
    assert len(examples) == 1 and dropped == 1


class Measuring:
    """The char tokenizer, noting the longest text it was given."""

    def __init__(self):
        self.longest = 0

    def __getattr__(self, name):
        return getattr(TOKENIZER, name)

    def encode(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return TOKENIZER.encode(text, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        self.longest = max(self.longest, sum(len(m["content"]) for m in messages))
        return TOKENIZER.apply_chat_template(messages, **kwargs)


def test_rows_longer_than_any_tokenization_of_max_length_are_dropped_untokenized():
    huge = "9" * 100_000
    rows = [
        ([{"role": "user", "content": "1+2="}], "3"),
        ([{"role": "user", "content": huge}], "3"),
        ([{"role": "user", "content": "1+2="}], huge),
        [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": huge}],
    ]
    tokenizer = Measuring()
    examples, dropped = tokenize_sft_rows(rows, tokenizer, EOS, max_length=64)
    assert len(examples) == 1 and dropped == 3
    assert tokenizer.longest < 100


def test_bad_sft_row_is_named(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "1+2="}) + "\n")
    with pytest.raises(DataSchemaError, match=r"sft\.jsonl: line 1: missing key 'response'"):
        load_sft_rows(path)
    path.write_text(json.dumps({"prompt": "1+2=", "response": "3\udfff"}) + "\n")
    with pytest.raises(DataSchemaError, match=r"line 1: key 'response' holds a lone UTF-16"):
        load_sft_rows(path)


def test_packing_is_greedy_in_order_and_respects_budget():
    assert pack_examples([3, 4, 2, 5, 1], max_tokens=7) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="example 1"):
        pack_examples([3, 9], max_tokens=8)


def test_collate_packed_restarts_positions():
    rows = [
        ([{"role": "user", "content": "1+2="}], "3"),
        ([{"role": "user", "content": "5="}], "5"),
    ]
    examples, _ = tokenize_sft_rows(rows, TOKENIZER, EOS)
    packed = collate_packed(examples)
    n0, n1 = len(examples[0].input_ids), len(examples[1].input_ids)
    assert packed["input_ids"].shape == (1, n0 + n1)
    assert packed["position_ids"][0].tolist() == list(range(n0)) + list(range(n1))
    assert packed["cu_seqlens"].tolist() == [0, n0, n0 + n1]
    assert packed["loss_mask"].sum() == 4
