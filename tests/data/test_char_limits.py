"""The character bound of a token: no text has more characters than its tokens can stand
for, in a byte-level BPE with Unicode normalization as chat models use, so no prompt within a
token limit is dropped by its character count."""

import pytest

from hybridflow.data.char_limits import (
    UNICODE_COMPOSITION,
    char_limit,
    keep_last_chars,
    max_chars_per_token,
    text_chars,
)
from hybridflow.models.tokenizer import build_char_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 40,
    " " * 3000,  # runs of one character merge into the longest tokens
    "x" * 3000,
    "def f(x):\n    return x * 2\n\n" * 50,
    "数学题：一加二等于几？" * 100,
    "🙂🚀" * 200,
    "\u03b1\u0313\u0301\u0345" * 300,  # alpha + three marks: NFC makes the 4 characters one
    "e\u0301" * 500,
]


def train_byte_level_bpe(texts, vocab_size=600):
    """A byte-level BPE trained on `texts` (so long merges exist), normalizing to NFC."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts * 5, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def byte_level_bpe():
    return train_byte_level_bpe(TEXTS)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_no_text_has_more_characters_than_its_tokens_can_stand_for(byte_level_bpe, text):
    tokens = len(byte_level_bpe.encode(text).ids)
    assert len(text) <= tokens * max_chars_per_token(byte_level_bpe)


def test_composition_is_what_the_factor_covers():
    """NFC makes 4 characters one of 3 bytes, so a byte-level token stands for 4/3 of its
    length: the bound holds with the factor and would not without it."""
    text = TEXTS[6]
    tokenizer = train_byte_level_bpe([text], vocab_size=300)
    tokens = len(tokenizer.encode(text).ids)
    longest_token = max_chars_per_token(tokenizer) // UNICODE_COMPOSITION
    assert tokens * longest_token < len(text) <= tokens * max_chars_per_token(tokenizer)


def test_the_char_tokenizers_bound_is_its_longest_special_token():
    assert max_chars_per_token(build_char_tokenizer()) == 4 * len("<|endoftext|>")
    assert char_limit(build_char_tokenizer(), None) is None


def test_a_tokenizer_without_a_vocabulary_has_no_bound():
    class Opaque:
        def encode(self, text, **kwargs):
            return list(text.encode())

    assert max_chars_per_token(Opaque()) is None and char_limit(Opaque(), 8) is None


def test_keep_last_chars_keeps_the_end_of_the_conversation():
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "abcdef"},
                {"role": "assistant", "content": "gh"}]  # fmt: skip
    assert keep_last_chars(messages, 5) == [{"role": "user", "content": "def"},
                                            {"role": "assistant", "content": "gh"}]  # fmt: skip
    assert keep_last_chars(messages, 100) == messages
    assert text_chars(messages, "xy") == 13
