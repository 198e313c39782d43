"""Chat messages as OpenAI's API sends them -> what the chat template renders: each
message's content one string, an assistant's `tool_calls` written into it as Hermes text.

Content parts: `text` parts are joined by newlines; an `image_url` part (a base64 data URL;
http(s) URLs are refused, never fetched) takes its place in that text as IMAGE_MARK, the
vision tokens Qwen2-VL's chat template writes for an image (the data path's `<image>`
placeholder becomes the same), and its bytes are kept, in order, as an ImagePart. Whether
the model takes images, and what the bytes hold, the server checks (serve/images.py).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from hybridflow.data.images import IMAGE_PAD, VISION_END, VISION_START
from hybridflow.serve.json_text import lone_surrogate, surrogate_message
from hybridflow.serve.request_error import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles accepted; "developer" (OpenAI's newer name) is rendered as "system"."""

IMAGE_MARK = VISION_START + IMAGE_PAD + VISION_END
"""An image part's place in its message's content."""


@dataclass(frozen=True)
class ImagePart:
    """The image of one `image_url` part: where it is (messages[i].content[k], what a 400
    about it names) and its encoded bytes (PNG, JPEG, ...; decoded by the server)."""

    where: str
    data: bytes


def hermes_tool_calls_text(calls: list[dict], where: str) -> str:
    """An OpenAI assistant `tool_calls` list as Hermes text (Qwen2.5's rendering):
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per line."""
    blocks = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{at} must be {{'type': 'function', 'function': "
                               "{'name': ..., 'arguments': ...}}", at)  # fmt: skip
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                raise RequestError(f"{at}.function.arguments is not JSON ({error.msg})",
                                   f"{at}.function.arguments") from None  # fmt: skip
            surrogate = lone_surrogate(arguments)  # escaped inside the string: decoded only now
            if surrogate is not None:
                where = f"{at}.function.arguments"
                raise RequestError(surrogate_message(where, *surrogate[1:]), where,
                                   "invalid_unicode")  # fmt: skip
        payload = json.dumps({"name": function["name"], "arguments": arguments},
                             ensure_ascii=False)  # fmt: skip
        blocks.append(f"<tool_call>\n{payload}\n</tool_call>")
    return "\n".join(blocks)


def image_part(part: dict, where: str) -> ImagePart:
    """An `image_url` content part -> its image's bytes. Only data URLs: the server fetches
    nothing a request names (a URL could point anywhere its network reaches)."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise RequestError(f"{where}.image_url must be {{'url': 'data:image/png;base64,...'}}",
                           where)  # fmt: skip
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise RequestError(
            f"{where}: this server does not fetch image URLs ({scheme}://...): send the image "
            "inline, as a data URL (data:image/png;base64, then the file's bytes in base64)",
            where, "image_url_not_supported",
        )  # fmt: skip
    header, comma, payload = url.partition(",")
    media = header[len("data:") :].removesuffix(";base64")
    if (scheme != "data" or not comma or not header.endswith(";base64")
            or media and not media.startswith("image/")):  # fmt: skip
        raise RequestError(f"{where}.image_url.url must be a base64 data URL of an image "
                           f"(data:image/png;base64,...), got {url[:40]!r}", where)  # fmt: skip
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the data URL's payload is not valid base64", where,
                           "invalid_image") from None  # fmt: skip
    return ImagePart(where, data)


def _content(value: Any, where: str, optional: bool, images: list[ImagePart]) -> str:
    """A message's content as one string: text parts joined by newlines, each image part
    written as IMAGE_MARK in its place (its bytes appended to `images`)."""
    if value is None:
        if optional:
            return ""
        raise RequestError(f"{where}.content is missing", f"{where}.content")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                images.append(image_part(part, f"{where}.content[{k}]"))
                texts.append(IMAGE_MARK)
            elif kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise RequestError(f"{where}.content[{k}]: only text and image_url parts are "
                                   "supported", f"{where}.content[{k}]")  # fmt: skip
        return "\n".join(texts)
    raise RequestError(f"{where}.content must be a string or a list of text and image_url parts",
                       f"{where}.content")  # fmt: skip


def convert_messages(raw: Any) -> list[dict]:
    """OpenAI chat messages -> what the chat template renders (see ChatRequest.messages)."""
    return chat_messages(raw)[0]


def chat_messages(raw: Any) -> tuple[list[dict], list[ImagePart]]:
    """OpenAI chat messages -> (what the chat template renders, the images of their
    image_url parts in order: each an IMAGE_MARK in its message's content)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list", "messages")
    out: list[dict] = []
    images: list[ImagePart] = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}",
                               f"{where}.role")  # fmt: skip
        calls = message.get("tool_calls") if role == "assistant" else None
        content = _content(message.get("content"), where, role == "assistant", images)
        if calls:
            if not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            text = hermes_tool_calls_text(calls, where)
            content = f"{content}\n{text}" if content else text
        converted = {"role": "system" if role == "developer" else role, "content": content}
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                converted[key] = message[key]
        out.append(converted)
    return out, images
