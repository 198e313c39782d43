"""Requests -> prompt token ids, checked: within the context, in the vocabulary, and never
tokenized when the text alone is too long to fit (limits.py: a text of more than
max_seq_len x chars_per_token characters is refused before the tokenizer sees it, so one
huge prompt costs its bytes, not a tokenization of them).

Chat requests with `tools` are refused when the chat template does not render tools: the
model would never see them, and the caller would get answers that ignore its tools with no
sign of why (vLLM likewise refuses tools it cannot handle).
"""

from __future__ import annotations

import json

from hybridflow.serve.limits import ServerLimits
from hybridflow.serve.openai_protocol import ChatRequest, RequestError

PROBE_TOOL = "hybridflow_probe_tool_7f3a"
"""A tool name no template writes unless it renders the tools it is given."""


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows the `tools` it is given (a probe tool's
    name appears in the rendered prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    tools = [{"type": "function", "function": {"name": PROBE_TOOL, "description": "probe",
              "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tools=tools,
                                             add_generation_prompt=True, tokenize=False)  # fmt: skip
    except Exception:  # a template that raises on tools does not render them either
        return False
    return PROBE_TOOL in text


class PromptBuilder:
    """The prompt ids of a request, checked (module docstring). max_seq_len: prompt +
    completion tokens; vocab_size: the model's (token ids must be below it)."""

    def __init__(self, tokenizer, max_seq_len: int, vocab_size: int, limits: ServerLimits):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.max_chars = limits.prompt_chars(max_seq_len)
        self._renders_tools: bool | None = None  # probed on the first request with tools

    @property
    def renders_tools(self) -> bool:
        if self._renders_tools is None:
            self._renders_tools = template_renders_tools(self.tokenizer)
        return self._renders_tools

    def check_length(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise RequestError("the prompt is empty (no tokens)", param)
        if len(ids) >= self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this server's max_seq_len is "
                f"{self.max_seq_len}, so a prompt may have at most {self.max_seq_len - 1}",
                param, "context_length_exceeded",
            )  # fmt: skip
        return ids

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of the vocabulary [0, "
                               f"{self.vocab_size})", param)  # fmt: skip
        return ids

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse, untokenized, a prompt text of `chars` characters that cannot fit."""
        if chars > self.max_chars:
            raise RequestError(
                f"the prompt text has {chars} characters; this server's max_seq_len is "
                f"{self.max_seq_len} tokens, and a text longer than {self.max_chars} characters "
                f"({self.max_chars // self.max_seq_len} a token) cannot fit: it is refused "
                "before tokenizing. Shorten the prompt",
                param, "context_length_exceeded",
            )  # fmt: skip

    def completion_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """The ids of /v1/completions' prompts (strings or token ids), every text's length
        checked before any is tokenized."""
        params = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        for prompt, param in zip(prompts, params):
            if isinstance(prompt, str):
                self.check_chars(len(prompt), param)
        out = []
        for prompt, param in zip(prompts, params):
            if isinstance(prompt, str):
                ids = list(self.tokenizer.encode(prompt))  # the tokenizer's special tokens (BOS)
            else:
                ids = self.check_ids(prompt, param)
            out.append(self.check_length(ids, param))
        return out

    def check_chat(self, req: ChatRequest) -> None:
        """What must hold before a chat is rendered: its text can fit, and its tools can be
        shown to the model."""
        chars = sum(len(m["content"]) for m in req.messages)
        if req.tools:
            chars += len(json.dumps(req.tools))
        self.check_chars(chars, "messages")
        if req.tools and not self.renders_tools:
            raise RequestError(
                "this server's chat template does not render `tools`, so the model would "
                "never see them: send the request without `tools` (describe them in a system "
                "message), or start the server with a --chat-template that renders tools",
                "tools", "tools_not_supported",
            )  # fmt: skip

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        from jinja2 import TemplateError

        from hybridflow.agents.loop import ChatRenderer

        self.check_chat(req)
        try:
            ids = ChatRenderer(self.tokenizer, req.tools).prompt_ids(req.messages)
        except (TemplateError, ValueError, TypeError, KeyError) as error:
            raise RequestError(f"the chat template could not render the messages: {error}",
                               "messages", "template_error") from None  # fmt: skip
        return self.check_length(self.check_ids(ids, "messages"), "messages")
