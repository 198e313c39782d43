import pytest

from hybridflow.data.char_tokenizer import CharTokenizer


def test_round_trip_and_save_load(tmp_path):
    tokenizer = CharTokenizer.for_arithmetic()
    assert tokenizer.vocab_size == 25
    ids = tokenizer.encode("12+34=46")
    assert tokenizer.decode(ids) == "12+34=46" and len(ids) == 8
    tokenizer.save_pretrained(tmp_path)
    loaded = CharTokenizer.from_pretrained(tmp_path)
    assert loaded.encode("12+34=46") == ids and loaded.vocab_size == 25


def test_chat_template_text_and_unknown_chars():
    tokenizer = CharTokenizer.for_arithmetic()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False)
    assert text == "<|user|>1+1=<|eos|><|assistant|>"
    assert tokenizer.encode("a") == [tokenizer.unk_token_id]
    with pytest.raises(ValueError, match="role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
