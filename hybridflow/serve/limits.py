"""What one client may cost the server: request size, prompt size and how long it may take
to send a request. Each limit is checked before the work it protects: the body's size
before it is read, the prompt's characters before it is tokenized, the headers' and the
body's arrival time while they arrive (connections.py), so a request that breaks one is
refused at the cost of its own bytes, never of its tokenization.

    limits = ServerLimits(header_timeout_s=5)
    app = build_app(engine, tokenizer, "my-model", limits=limits)

Defaults are sized from the model's context: a body can hold any prompt that could fit, and
little more (max_request_bytes); `hybridflow serve --max-request-bytes`, `--header-timeout`
and `--body-timeout` change them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.data.images import MAX_IMAGE_PIXELS

CHARS_PER_TOKEN = 32
"""Characters one prompt token may stand for, generously: English and code average 3 to 4
characters a token, and text averaging 32 (long runs of one character) is not a prompt
anyone needs; a longer prompt text could not fit the context and is refused untokenized."""

JSON_BYTES_PER_CHAR = 6
"""The most bytes one character of a JSON string takes (a \\u escape, as Python's json.dumps
writes anything outside ASCII by default)."""

JSON_ALLOWANCE_BYTES = 2**20
"""Room in a body besides the prompt text: the JSON structure, sampling fields, tool schemas."""

IMAGE_ALLOWANCE_BYTES = 32 * 2**20
"""Room in a body to a vision-language model for its images, as base64 data URLs (4/3 of
their files' size): OpenAI's API takes 50 MB a request."""


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits per request and per connection (module docstring)."""

    max_request_bytes: int | None = None
    """The largest request body. None: room for the longest prompt text the context could
    take (max_seq_len x chars_per_token characters, each up to 6 bytes of JSON) plus 1 MiB,
    plus image_bytes for a vision-language model.
    A larger body is answered 413 before it is read (by its Content-Length) or as soon as
    the bytes read pass this."""
    chars_per_token: int = CHARS_PER_TOKEN
    """A prompt text (a completion prompt, or a chat's messages and tools together) longer
    than max_seq_len x this many characters is refused (400, context_length_exceeded)
    before the tokenizer sees it."""
    header_timeout_s: float = 10.0
    """Seconds a client has to send a request's line and headers, from the connect or from
    the previous response on a kept-alive connection. Then the connection is closed (with a
    408 when a request had begun): a client sending its headers byte by byte, or none,
    holds a socket this long at most. Idle keep-alive connections close after it too."""
    body_timeout_s: float = 30.0
    """Seconds a client has to send the request body once its headers are in: then 408 and
    the connection is closed."""
    max_n: int = 128
    """The largest `n` (samples of one prompt)."""
    max_choices: int = 1024
    """The most choices one request may ask for: prompts x n (a batch of prompts on
    /v1/completions)."""
    max_stops: int = 16
    """The most `stop` strings of one request (OpenAI takes 4): every decoded piece is
    searched for each."""
    image_bytes: int = IMAGE_ALLOWANCE_BYTES
    """Added to the default max_request_bytes when the model takes images (their data URLs)."""
    max_images: int = 16
    """The most images (image_url parts) of one chat request."""
    max_image_pixels: int = MAX_IMAGE_PIXELS
    """An image with more pixels (width x height, read from its header) is refused: the data
    path's limit (data/images.py)."""

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)} must be > 0"
                    for name in ("chars_per_token", "header_timeout_s", "body_timeout_s", "max_n",
                                 "max_choices", "max_stops", "image_bytes", "max_images",
                                 "max_image_pixels")
                    if not getattr(self, name) > 0]  # fmt: skip
        if self.max_request_bytes is not None and not self.max_request_bytes > 0:
            problems.append(f"max_request_bytes={self.max_request_bytes} must be > 0")
        if problems:
            raise ValueError("invalid ServerLimits: " + "; ".join(problems))

    def prompt_chars(self, max_seq_len: int) -> int:
        """The most characters of prompt text taken for tokenizing."""
        return max_seq_len * self.chars_per_token

    def request_bytes(self, max_seq_len: int, images: bool = False) -> int:
        """The largest request body (max_request_bytes, or what it defaults to; images: the
        model takes images, and the default has room for them)."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        text = self.prompt_chars(max_seq_len) * JSON_BYTES_PER_CHAR + JSON_ALLOWANCE_BYTES
        return text + (self.image_bytes if images else 0)
