"""Streaming text (streaming.py): pieces sent as tokens arrive, in any chunking, add up to
what finish_output makes of the whole completion; and, through the server, text arrives
while the request still decodes, and a client that hangs up has its request aborted."""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest
from serve_helpers import TOKENIZER

from hybridflow.serve.streaming import TextStream
from hybridflow.serve.text import finish_output

EOS = TOKENIZER.eos_token_id


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


CASES = [  # (text, stop strings, engine finish reason, ends with the stop token)
    ("hello world, and more", [], "length", False),
    ("hello world", [], "stop", True),
    ("xxabcdyy and then some", ["abcd", "bc"], "length", False),
    ("a stop: STOP here", ["STOP"], "length", False),
    ("nothing to cut", ["zzz"], "stop", True),
    ("ends with a partial sto", ["stop!"], "length", False),
]


@pytest.mark.parametrize("text, stops, reason, with_eos", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_pieces_add_up_to_the_finished_output(text, stops, reason, with_eos, seed):
    ids = _ids(text) + ([EOS] if with_eos else [])
    logprobs = [-0.1 * (k + 1) for k in range(len(ids))]
    expected = finish_output(TOKENIZER, ids, logprobs, reason, stops)
    stream, emits, position, chunks = (
        TextStream(TOKENIZER, stops, {EOS}),
        [],
        0,
        random.Random(seed),
    )
    while position < len(ids) and not stream.stopped:
        size = chunks.randint(1, 5)
        emits += stream.push(ids[position : position + size], logprobs[position : position + size])
        position += size
    emits += stream.finish()
    assert "".join(e.text for e in emits) == expected.text
    assert [e.index for e in emits] == list(range(len(expected.token_ids)))
    assert [e.logprob for e in emits] == expected.logprobs
    assert [e.offset for e in emits] == expected.offsets
    assert [e.token for e in emits] == expected.tokens
    assert stream.stopped == (expected.finish_reason == "stop" and reason != "stop")


def test_nothing_that_could_start_a_stop_string_is_sent_early():
    stream = TextStream(TOKENIZER, ["STOP"], {EOS})
    sent = "".join(e.text for e in stream.push(_ids("abc ST"), [0.0] * 6))
    assert sent == "abc"  # " ST" could become "STOP"... no: " " is safe, "ST" held
    sent += "".join(e.text for e in stream.push(_ids("OP"), [0.0] * 2))
    assert stream.stopped and sent + "".join(e.text for e in stream.finish()) == "abc "


def test_a_character_split_over_byte_tokens_streams_whole():
    tokenizer = _byte_tokenizer()
    ids = tokenizer.encode("a\u00e9\u20acb", add_special_tokens=False)
    stream = TextStream(tokenizer, [], set())
    texts = [e.text for k in range(len(ids)) for e in stream.push(ids[k : k + 1], [0.0])]
    texts += [e.text for e in stream.finish()]
    assert "".join(texts) == "a\u00e9\u20acb"
    cut = TextStream(tokenizer, [], set())
    pieces = [e.text for e in cut.push(ids[:4], [0.0] * 4)] + [e.text for e in cut.finish()]
    assert "".join(pieces) == finish_output(tokenizer, ids[:4], [0.0] * 4, "length", []).text


def _post_stream(url: str, body: dict):
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    return urllib.request.urlopen(request)


def test_text_arrives_while_decoding_and_a_hangup_aborts_the_request(tiny_server, engine_client):
    scheduler = engine_client.engine.scheduler
    steps = scheduler.decode_steps if scheduler else 0
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 480, "stream": True,
            "ignore_eos": True, "seed": 1}  # fmt: skip
    response = _post_stream(tiny_server.url + "/v1/completions", body)
    first = response.readline()
    while first.strip() == b"":
        first = response.readline()
    assert first.startswith(b"data: ") and b'"text"' in first
    scheduler = engine_client.engine.scheduler
    assert scheduler.rows, "the request should still be decoding when its first text arrives"
    response.close()  # the client hangs up
    deadline = time.monotonic() + 30
    while scheduler.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not scheduler.busy
    assert scheduler.decode_steps - steps < 480  # aborted before its 480 tokens
