"""Who answers a judge: the policy's own rollout service, or a second model behind an
OpenAI-compatible server. Each is an ``Ask``: judge prompts -> one ScoreOutcome each (the
reply text, or why there is none)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hybridflow.rewards.judge import Ask
from hybridflow.rewards.parallel import ScoreOutcome


def rollout_asker(rollout: Any, tokenizer: Any, max_prompt_length: int,
                  sampling: dict[str, Any]) -> Ask:  # fmt: skip
    """Greedy replies of the policy's rollout group (``rollout.generate``): each judge prompt
    is one user turn of the policy's chat template, at most ``max_prompt_length`` tokens (a
    longer one is a failed sample); replies are at most data.max_response_length tokens.
    sampling: the rollout's batch meta (pad and stop ids; n and temperature are set here)."""
    import torch

    from hybridflow.protocol import Batch
    from hybridflow.rewards.placement import decode_responses

    def ask(prompts: list[str]) -> list[ScoreOutcome]:
        outcomes: list[ScoreOutcome | None] = [None] * len(prompts)
        rows, kept = [], []
        for i, prompt in enumerate(prompts):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)  # fmt: skip
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            if len(ids) > max_prompt_length:
                outcomes[i] = ScoreOutcome("error", message=(
                    f"judge prompt of {len(ids)} tokens exceeds data.max_prompt_length = "
                    f"{max_prompt_length} (the rollout's limit): shorten the template"))  # fmt: skip
            else:
                rows.append(ids)
                kept.append(i)
        if rows:
            pad = sampling.get("pad_token_id", 0)
            width = max(map(len, rows))
            prompts_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # [B, P]
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            request = Batch({"prompts": prompts_ids, "attention_mask": mask})
            request.meta.update({**sampling, "n": 1, "temperature": 0.0})
            out = rollout.generate(request)
            replies = decode_responses(tokenizer, out.tensors["responses"],
                                       out.tensors["response_mask"])  # fmt: skip
            for i, reply in zip(kept, replies):
                outcomes[i] = ScoreOutcome("ok", reply)
        return outcomes

    return ask


MIN_REPLY_BYTES = 1 << 20
REPLY_BYTES_PER_TOKEN = 64
"""A reply's body may hold this many bytes per requested token (at least MIN_REPLY_BYTES):
far more than a token's text escaped in JSON, far less than an endless reply."""


class ReplyTooLarge(ValueError):
    """The server sent more than the reply's byte limit (an endless or runaway reply)."""


def read_bounded(response, max_bytes: int, deadline: float) -> bytes:
    """The body of ``response`` (an http.client.HTTPResponse), failing past ``max_bytes``
    or after the monotonic ``deadline``: memory and time bounded whatever the server sends
    (each read waits at most the socket timeout)."""
    body = bytearray()
    while chunk := response.read1(1 << 16):
        body += chunk
        if len(body) > max_bytes:
            raise ReplyTooLarge(f"reply larger than {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise TimeoutError
    return bytes(body)


CONNECTION_RETRIES = 3
"""A refused or dropped connection is tried again this many times (0.2 s, 0.4 s, 0.8 s
apart, within the request's deadline): a server under a burst of requests drops some
connections from its backlog, which says nothing about the sample."""


def post_retrying(request, max_reply_bytes: int, deadline: float) -> bytes:
    """The reply body of ``request``, trying again on a refused or reset connection while
    ``deadline`` (time.monotonic) leaves time for it; else that connection's error."""
    for attempt in range(CONNECTION_RETRIES + 1):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        try:
            with urllib.request.urlopen(request, timeout=remaining) as response:
                return read_bounded(response, max_reply_bytes, deadline)
        except (ConnectionError, urllib.error.URLError) as error:
            dropped = isinstance(getattr(error, "reason", error), ConnectionError)
            pause = 0.2 * 2**attempt
            if not dropped or isinstance(error, urllib.error.HTTPError):
                raise
            if attempt == CONNECTION_RETRIES or time.monotonic() + pause >= deadline:
                raise
            time.sleep(pause)
    raise AssertionError("unreachable: the last attempt returns or raises")


def url_asker(url: str, model: str, max_tokens: int, timeout_s: float,
              concurrency: int) -> Ask:  # fmt: skip
    """Greedy chat completions from an OpenAI-compatible server (``hybridflow serve``,
    vLLM): ``concurrency`` requests in flight, each limited to ``timeout_s`` and to a reply
    of MIN_REPLY_BYTES or REPLY_BYTES_PER_TOKEN × ``max_tokens`` bytes."""
    endpoint = url.rstrip("/") + "/chat/completions"
    max_reply_bytes = max(MIN_REPLY_BYTES, REPLY_BYTES_PER_TOKEN * max_tokens)

    def one(prompt: str) -> ScoreOutcome:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": max_tokens, "temperature": 0.0}).encode()  # fmt: skip
        request = urllib.request.Request(endpoint, body, {"Content-Type": "application/json"})
        deadline = time.monotonic() + timeout_s
        try:
            reply = json.loads(post_retrying(request, max_reply_bytes, deadline))
            content = reply["choices"][0]["message"]["content"] or ""
            if not isinstance(content, str):  # its text would be parsed for a score
                raise TypeError(f"the reply's message content is a {type(content).__name__}, "
                                "not text")  # fmt: skip
            return ScoreOutcome("ok", content)
        except TimeoutError:
            return ScoreOutcome("timeout", message=f"judge {endpoint} took more than {timeout_s}s")
        except urllib.error.URLError as error:
            if isinstance(error.reason, (TimeoutError, socket.timeout)):
                return ScoreOutcome("timeout",
                                    message=f"judge {endpoint} took more than {timeout_s}s")  # fmt: skip
            return ScoreOutcome("error", message=f"judge {endpoint}: {error}")
        except (OSError, ValueError, KeyError, IndexError, TypeError, RecursionError) as error:
            return ScoreOutcome("error", message=f"judge {endpoint}: {type(error).__name__}: "
                                f"{error}")  # fmt: skip

    def ask(prompts: list[str]) -> list[ScoreOutcome]:
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(concurrency, len(prompts))) as pool:
            return list(pool.map(one, prompts))

    return ask


def build_judge(judge_options: Any, rollout: Any, tokenizer: Any, max_prompt_length: int,
                sampling: dict[str, Any]):  # fmt: skip
    """The JudgeReward of the ``reward.judge`` config section (validate() checked it)."""
    from pathlib import Path

    from hybridflow.rewards.judge import JudgeReward

    template = Path(judge_options.template).expanduser().read_text(encoding="utf-8")
    if judge_options.engine == "url":
        ask = url_asker(judge_options.url, judge_options.model, judge_options.max_tokens,
                        judge_options.timeout_s, judge_options.concurrency)  # fmt: skip
    else:
        ask = rollout_asker(rollout, tokenizer, max_prompt_length, sampling)
    return JudgeReward(template, judge_options.score_pattern, ask)
