"""The OpenAI API's request bodies, checked into plain dataclasses, and its response shapes.

Nothing here knows the engine, the tokenizer or aiohttp: `parse_completion_request` and
`parse_chat_request` turn a decoded JSON body into a request or raise RequestError (HTTP 400
with an OpenAI-style error body, naming the field); the `*_response` and `*_chunk` functions
build the JSON the official clients read.

Supported besides the standard fields (vLLM's names): `top_k`, `min_p`, `stop_token_ids`,
`ignore_eos`, `skip_special_tokens`. Rejected with a 400 rather than silently ignored
(they would change what the caller gets): `echo`, `suffix`, `best_of` other than n,
`logit_bias`, non-zero `presence_penalty` / `frequency_penalty`, `response_format` other than
text, `tool_choice` "required" or a named function, the legacy `functions` / `function_call`,
top-k log-prob alternatives (`top_logprobs` > 0). Other unknown fields are ignored.

Chat content parts: `text`, and `image_url` as a base64 data URL for a vision-language
model (chat_messages.py; the server checks the images: images.py).

Numbers must be finite (Python's JSON reads NaN and Infinity) and in range: temperature 0 or
in [1e-6, 1000]; `n`, the choices of a request (prompts x n) and the `stop` strings are
capped by the server's ServerLimits (limits.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hybridflow.serve.chat_messages import (
    ROLES,
    ImagePart,
    chat_messages,
    convert_messages,
    hermes_tool_calls_text,
)
from hybridflow.serve.limits import ServerLimits
from hybridflow.serve.request_error import RequestError, error_body

__all__ = ["ROLES", "RequestError", "convert_messages", "error_body", "hermes_tool_calls_text"]

SEED_RANGE = 2**62
"""Seeds are taken modulo this (the engine's seeds are non-negative int64)."""

MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1000.0
"""A temperature other than 0 (greedy) is taken in [MIN_TEMPERATURE, MAX_TEMPERATURE]: the
engine divides float32 logits by it, which past these ends overflows (to NaN, an empty
completion) or cannot be stored; at 1000 sampling is uniform already."""


# -- field checks ------------------------------------------------------------------------------


def _present(body: dict, name: str) -> bool:
    return body.get(name) is not None


def _int(body: dict, name: str, default: int | None, minimum: int | None = None,
         maximum: int | None = None) -> int | None:  # fmt: skip
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise RequestError(f"{name}={value} must be >= {minimum}", name)
    if maximum is not None and value > maximum:
        raise RequestError(f"{name}={value} must be <= {maximum}", name)
    return value


def _float(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float
        value = math.inf
    if not math.isfinite(value):  # Python's JSON reads NaN, Infinity and 1e999
        raise RequestError(f"{name} must be a finite number, got {value}", name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _stops(body: dict, max_stops: int) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > max_stops:
        raise RequestError(f"stop has {len(stops)} strings; this server takes at most "
                           f"{max_stops}", "stop")  # fmt: skip
    return list(stops)


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise RequestError(f"{name} must be a list of integer token ids", name)
    return list(value)


def _unsupported(body: dict) -> None:
    """400 for the fields whose effect this server cannot give."""
    if body.get("echo"):
        raise RequestError("echo is not supported", "echo")
    if body.get("suffix"):
        raise RequestError("suffix is not supported", "suffix")
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if _float(body, name, 0.0) != 0.0:
            raise RequestError(f"{name} is not supported (only 0)", name)
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise RequestError("functions / function_call are not supported: use tools", "functions")
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise RequestError("response_format other than {'type': 'text'} is not supported",
                           "response_format")  # fmt: skip


# -- sampling ----------------------------------------------------------------------------------


@dataclass
class Sampling:
    """The sampling fields common to both endpoints."""

    n: int = 1
    max_tokens: int | None = None
    """None: up to the server's max_seq_len."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False

    def choice_seed(self, index: int) -> int | None:
        """Choice `index`'s seed: the request's for choice 0 (so n=1 and choice 0 of n>1
        sample alike), then well-spread values (not seed + 1, which a caller stepping its
        seeds per turn would reuse)."""
        if self.seed is None:
            return None
        return (self.seed + index * 0x9E3779B97F4A7C15) % SEED_RANGE


def parse_sampling(body: dict, max_tokens_default: int | None, limits: ServerLimits) -> Sampling:
    n = _int(body, "n", 1, minimum=1, maximum=limits.max_n)
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise RequestError("best_of other than n is not supported", "best_of")
    name = "max_completion_tokens" if _present(body, "max_completion_tokens") else "max_tokens"
    max_tokens = _int(body, name, max_tokens_default, minimum=1)
    temperature = _float(body, "temperature", 1.0)
    if temperature != 0 and not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise RequestError(f"temperature={temperature:g} must be 0 (greedy) or between "
                           f"{MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}", "temperature")  # fmt: skip
    top_p = _float(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p={top_p:g} must be in (0, 1]", "top_p")
    top_k = _int(body, "top_k", -1, minimum=-1)
    min_p = _float(body, "min_p", 0.0)
    if not 0 <= min_p < 1:
        raise RequestError(f"min_p={min_p:g} must be in [0, 1)", "min_p")
    seed = _int(body, "seed", None)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    stop_token_ids = (
        _token_ids(body["stop_token_ids"], "stop_token_ids")
        if _present(body, "stop_token_ids") else []
    )  # fmt: skip
    return Sampling(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop=_stops(body, limits.max_stops),
        stop_token_ids=stop_token_ids,
        seed=None if seed is None else seed % SEED_RANGE,
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        stream=stream,
        include_usage=include_usage,
    )


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    return model


def _user_and_metadata(body: dict) -> tuple[str | None, dict | None]:
    user, metadata = body.get("user"), body.get("metadata")
    if user is not None and not isinstance(user, str):
        raise RequestError("user must be a string", "user")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError("metadata must be an object", "metadata")
    return user, metadata


# -- /v1/completions ---------------------------------------------------------------------------


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    """Each a string (to encode) or token ids."""
    sampling: Sampling
    logprobs: int | None
    """None: no log-probs; an int: the sampled tokens' (alternatives are not returned)."""
    user: str | None = None
    metadata: dict | None = None


def parse_completion_request(body: dict, limits: ServerLimits | None = None) -> CompletionRequest:
    limits = limits or ServerLimits()
    _unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt:
        prompts = []
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                prompts.append(item)
            else:
                prompts.append(_token_ids(item, f"prompt[{i}]"))
    else:
        raise RequestError("prompt must be a string, a list of token ids, or a non-empty list "
                           "of those", "prompt")  # fmt: skip
    user, metadata = _user_and_metadata(body)
    sampling = parse_sampling(body, max_tokens_default=16, limits=limits)  # OpenAI's default
    if len(prompts) * sampling.n > limits.max_choices:
        raise RequestError(f"{len(prompts)} prompts x n={sampling.n} is {len(prompts) * sampling.n} "
                           f"choices; this server makes at most {limits.max_choices} a request: "
                           "send the prompts in several requests", "prompt")  # fmt: skip
    return CompletionRequest(
        model=_model(body),
        prompts=prompts,
        sampling=sampling,
        logprobs=_int(body, "logprobs", None, minimum=0),
        user=user,
        metadata=metadata,
    )


# -- /v1/chat/completions ----------------------------------------------------------------------


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    """As the chat template takes them: role, content (a string), tool messages' ids and
    names; an assistant message's tool_calls are already Hermes text in its content."""
    tools: list[dict] | None
    parse_tool_calls: bool
    """False with tool_choice "none" (and without tools): the text is returned as content."""
    sampling: Sampling
    logprobs: bool
    user: str | None = None
    metadata: dict | None = None
    images: list[ImagePart] = field(default_factory=list)
    """The images of the messages' image_url parts, in order (chat_messages.py)."""


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': "
                               "{'name': ..., 'parameters': {...}}}", f"tools[{i}]")  # fmt: skip
    return tools or None


def parse_chat_request(body: dict, limits: ServerLimits | None = None) -> ChatRequest:
    limits = limits or ServerLimits()
    _unsupported(body)
    messages, images = chat_messages(body.get("messages"))
    tools = _tools(body)
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise RequestError("tool_choice must be 'auto' or 'none' (forcing a call needs "
                           "constrained decoding, which this server does not do)",
                           "tool_choice")  # fmt: skip
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0, minimum=0)
    if top_logprobs:
        raise RequestError("top_logprobs > 0 is not supported: only the sampled token's "
                           "log-prob is returned (top_logprobs 0)", "top_logprobs")  # fmt: skip
    user, metadata = _user_and_metadata(body)
    return ChatRequest(
        model=_model(body),
        messages=messages,
        tools=tools,
        parse_tool_calls=bool(tools) and tool_choice != "none",
        sampling=parse_sampling(body, max_tokens_default=None, limits=limits),
        logprobs=logprobs,
        user=user,
        metadata=metadata,
        images=images,
    )


# -- responses ---------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


LOGPROB_FLOOR = -9999.0
"""What a log-prob of -inf (a token of probability 0) is sent as: JSON has no infinity, and
OpenAI's API and vLLM send this number."""


def json_logprob(logprob: float) -> float | None:
    """``logprob`` as the JSON number sent: -inf as LOGPROB_FLOOR, NaN (and +inf, which no
    probability has) as null."""
    if math.isfinite(logprob):
        return logprob
    return LOGPROB_FLOOR if logprob == -math.inf else None


def completion_logprobs(tokens: list[str], logprobs: list[float], offsets: list[int]) -> dict:
    """The completions `logprobs` object; top_logprobs is null (no alternatives)."""
    return {"tokens": tokens, "token_logprobs": [json_logprob(lp) for lp in logprobs],
            "text_offset": offsets, "top_logprobs": None}  # fmt: skip


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    """The chat `logprobs` object: one entry per token, no alternatives."""
    return {
        "content": [
            {
                "token": t,
                "logprob": json_logprob(lp),
                "bytes": list(t.encode("utf-8")),
                "top_logprobs": [],
            }  # fmt: skip
            for t, lp in zip(tokens, logprobs)
        ],
        "refusal": None,
    }


def completion_response(id: str, created: int, model: str, choices: list[dict],
                        usage: dict) -> dict:  # fmt: skip
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}  # fmt: skip


def chat_response(id: str, created: int, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage}  # fmt: skip


def completion_chunk(id: str, created: int, model: str, choices: list[dict],
                     usage: dict | None = None) -> dict:  # fmt: skip
    chunk = {"id": id, "object": "text_completion", "created": created, "model": model,
             "choices": choices}  # fmt: skip
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def chat_chunk(id: str, created: int, model: str, choices: list[dict],
               usage: dict | None = None) -> dict:  # fmt: skip
    chunk = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}  # fmt: skip
    if usage is not None:
        chunk["usage"] = usage
    return chunk
