"""Chat completions with images (tiny-vl, fp32, CPU): an image_url part (a base64 data URL)
takes its place in the prompt as the data path's <image> does, and greedy decoding returns
the tokens and log-probs Engine.generate gives for that image; what cannot be served is a
400 naming the message and part (or 413 for a body over the cap, unread)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import openai
import pytest
import torch
from test_serve_limits import exchange, post_head

from hybridflow.agents.templates import with_tool_template
from hybridflow.data.images import ImageProcessor, image_prompt
from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.images import PromptImages
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.models.tokenizer import build_char_tokenizer
from hybridflow.serve.limits import ServerLimits

TOKENIZER = with_tool_template(build_char_tokenizer(vision=True))
MAX_SEQ_LEN = 256
LIMITS = ServerLimits(max_images=2, image_bytes=2**16)
QUESTION = "How many shapes?"
PAD = TOKENIZER.convert_tokens_to_ids("<|image_pad|>")


def png(width: int = 48, height: int = 40, color=(200, 30, 30), box=(8, 6, 30, 28)) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (255, 255, 255))
    ImageDraw.Draw(image).rectangle(box, fill=color)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG of that size whose pixel data is a few bytes: its size is read, its pixels
    never are (a 10000 x 10000 image, without making one)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0"))
            + chunk(b"IEND", b""))  # fmt: skip


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image_message(*images: bytes, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def model():
    """std-0.3 language-model weights (peaked logits: greedy far from ties), std-0.1 encoder
    weights (its features move the logits), as tests/engine/test_image_engine.py."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny-vl"), seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.1 if name.startswith("visual.") else 0.3, generator=generator)
    return model


def _engine(model) -> Engine:
    options = EngineOptions(decode_backend="torch", cuda_graphs=False)
    return Engine(model, max_batch_size=4, max_seq_len=MAX_SEQ_LEN, options=options)


@pytest.fixture(scope="module")
def vl_server(model):
    from hybridflow.serve.app import RECORDS, build_app
    from hybridflow.serve.running import BackgroundServer

    app = build_app(_engine(model), TOKENIZER, "tiny-vl", limits=LIMITS,
                    image_processor=ImageProcessor.for_model("tiny-vl"))  # fmt: skip
    with BackgroundServer(app) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        yield server, api, app[RECORDS]


def reference(model, image: bytes, max_new_tokens: int):
    """Engine.generate (no server, no service) on the data path's prompt with that image."""
    from PIL import Image

    messages = [{"role": "user", "content": f"<image>\n{QUESTION}"}]
    prompt = image_prompt(messages, [Image.open(io.BytesIO(image)).convert("RGB")], TOKENIZER,
                          ImageProcessor.for_model("tiny-vl"))  # fmt: skip
    images = [PromptImages(prompt.pixel_values, prompt.image_grid_thw, prompt.position_ids)]
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return prompt.prompt_ids, _engine(model).generate([prompt.prompt_ids], params,
                                                      images=images)[0]  # fmt: skip


def test_greedy_chat_with_an_image_returns_engine_generates_tokens_and_logprobs(model, vl_server):
    _, api, records = vl_server
    image = png()
    answer = api.chat.completions.create(model="tiny-vl", messages=image_message(image),
                                         max_tokens=8, temperature=0, logprobs=True,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    prompt_ids, expected = reference(model, image, 8)
    kept = records.get(answer.id).choices[0]
    assert list(kept.prompt_token_ids) == prompt_ids
    assert list(kept.token_ids) == expected.token_ids
    logprobs = [entry.logprob for entry in answer.choices[0].logprobs.content]
    assert logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert answer.usage.prompt_tokens == len(prompt_ids)
    # the image matters: another image, other tokens
    other = api.chat.completions.create(model="tiny-vl", max_tokens=8, temperature=0,
                                        messages=image_message(png(color=(20, 20, 220),
                                                                   box=(0, 0, 47, 12))),
                                        extra_body={"ignore_eos": True})  # fmt: skip
    assert list(records.get(other.id).choices[0].token_ids) != expected.token_ids


def test_streamed_chat_with_an_image_is_the_same_text(vl_server):
    _, api, _ = vl_server
    fields = dict(model="tiny-vl", messages=image_message(png()), max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = api.chat.completions.create(**fields).choices[0].message.content
    chunks = api.chat.completions.create(stream=True, **fields)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def _error(api, messages) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=2)
    return caught.value.body


@pytest.mark.parametrize("part, param, words", [
    ({"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}},
     "messages[1].content[0]", "cannot be decoded as an image"),
    ({"type": "image_url", "image_url": {"url": data_url(png_header(10_000, 10_000))}},
     "messages[1].content[0]", "more than 89478485 pixels"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "messages[1].content[0]", "does not fetch image URLs"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
     "messages[1].content[0]", "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}},
     "messages[1].content[0]", "data URL of an image"),
    ({"type": "input_audio", "input_audio": {}}, "messages[1].content[0]",
     "only text and image_url parts"),
])  # fmt: skip
def test_a_bad_image_part_is_a_400_naming_the_message_and_part(vl_server, part, param, words):
    _, api, _ = vl_server
    messages = [{"role": "system", "content": "count"}, {"role": "user", "content": [part]}]
    error = _error(api, messages)
    assert error["param"] == param and words in error["message"]
    assert error["message"].startswith("messages[1]")


def test_more_images_than_the_limit_is_a_400_naming_the_first_extra(vl_server):
    _, api, _ = vl_server
    error = _error(api, image_message(png(), png(), png()))
    assert error["param"] == "messages[0].content[2]" and "at most 2 images" in error["message"]


def test_text_spelling_the_image_token_is_a_400(vl_server):
    _, api, _ = vl_server
    error = _error(api, [{"role": "user", "content": "look: <|image_pad|>"}])
    assert "<|image_pad|>" in error["message"] and error["param"] == "messages"


def test_images_sent_to_a_text_only_model_are_a_400_naming_the_part(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=image_message(png()), max_tokens=2)
    error = caught.value.body
    assert error["param"] == "messages[0].content[0]" and "takes no images" in error["message"]


def test_the_body_cap_has_room_for_images_and_a_larger_body_is_413_unread(vl_server):
    server, _, _ = vl_server
    text_cap = LIMITS.request_bytes(MAX_SEQ_LEN)
    cap = LIMITS.request_bytes(MAX_SEQ_LEN, images=True)
    assert cap == text_cap + LIMITS.image_bytes
    status, body = exchange(server.url, post_head("/v1/chat/completions", cap + 1))
    assert status == 413 and str(cap) in body["error"]["message"]


def test_hybridflow_serve_of_a_vision_preset_answers_a_chat_with_an_image():
    from hybridflow.cli import build_parser
    from hybridflow.serve.app import RECORDS
    from hybridflow.serve.cli import build_from_args, check_paths
    from hybridflow.serve.running import BackgroundServer

    args = build_parser().parse_args(["serve", "--model", "tiny-vl", "--device", "cpu",
                                      "--max-seq-len", "128"])  # fmt: skip
    check_paths(args)
    app, name, _, _ = build_from_args(args)
    with BackgroundServer(app) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        answer = api.chat.completions.create(model=name, messages=image_message(png()),
                                             max_tokens=3, logprobs=True)  # fmt: skip
    prompt = list(app[RECORDS].get(answer.id).choices[0].prompt_token_ids)
    _, rows, cols = ImageProcessor.for_model("tiny-vl").grid_of(48, 40)
    assert name == "tiny-vl" and prompt.count(PAD) == rows * cols // 4 > 1
    assert len(answer.choices[0].logprobs.content) == answer.usage.completion_tokens


def test_images_whose_tokens_fill_the_context_are_a_400_naming_the_part():
    from hybridflow.serve.chat_messages import ImagePart
    from hybridflow.serve.images import ChatImages
    from hybridflow.serve.request_error import RequestError

    processor = ImageProcessor.for_model("tiny-vl")
    _, rows, cols = processor.grid_of(48, 40)
    images = ChatImages(processor, PAD, max_seq_len=rows * cols // 4 + 1, limits=LIMITS)
    parts = [ImagePart("messages[0].content[0]", png()), ImagePart("messages[0].content[1]", png())]
    assert len(images.preprocess(parts[:1])[1]) == 1
    with pytest.raises(RequestError) as caught:
        images.preprocess(parts)
    assert caught.value.param == "messages[0].content[1]"
    assert caught.value.code == "context_length_exceeded"


def test_an_image_in_a_request_of_an_episode_is_a_400(vl_server):
    from hybridflow.serve.episodes import EPISODE_HEADER

    _, api, _ = vl_server
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="tiny-vl", messages=image_message(png()), max_tokens=2,
                                    extra_headers={EPISODE_HEADER: "e1"})  # fmt: skip
    assert caught.value.body["param"] == "messages[0].content[0]"


def test_a_completion_prompt_of_image_tokens_is_a_400(vl_server):
    _, api, _ = vl_server
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="tiny-vl", prompt=[5, PAD, 6], max_tokens=2)
    assert (
        caught.value.body["param"] == "prompt" and "<|image_pad|>" in caught.value.body["message"]
    )
