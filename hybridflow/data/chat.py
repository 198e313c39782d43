"""Chat templates: turning chat messages into prompt token ids.

Any tokenizer with `apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)` and `encode(text, add_special_tokens=False)` works: a Hugging Face
tokenizer loaded from a model directory, or the built-in character-level one
(`hybridflow.models.tokenizer.load_tokenizer("char")`, itself a standard HF tokenizer).
Return types differ between transformers versions (a list, a nested list, a tensor, or a
`BatchEncoding` holding `input_ids` as transformers 5 does), so the result is normalised to
a flat `list[int]` here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hybridflow.errors import UserError


class ChatTokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


def as_token_list(output: Any) -> list[int]:
    """Normalise what a tokenizer returns to one flat list of ints."""
    if hasattr(output, "keys") and "input_ids" in output.keys():
        output = output["input_ids"]
    if hasattr(output, "tolist"):
        output = output.tolist()
    if isinstance(output, Sequence) and len(output) > 0 and isinstance(output[0], Sequence):
        if len(output) != 1:
            raise ValueError(f"expected token ids of one sequence, got {len(output)} sequences")
        output = output[0]
    return [int(token) for token in output]


def encode_chat_prompt(tokenizer: ChatTokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` followed by the assistant turn opener (generation prompt)."""
    if getattr(tokenizer, "chat_template", "") is None:  # a base model's tokenizer
        raise UserError(
            f"the tokenizer in {getattr(tokenizer, 'name_or_path', '?')} has no chat template, "
            "and prompts are chat messages",
            'add one to its tokenizer_config.json ("chat_template") or as chat_template.jinja, '
            "e.g. the instruct model's of the same family, or set model.tokenizer_path to a "
            "directory whose tokenizer has one",
        )
    output = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
    )
    return as_token_list(output)


def encode_text(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """Token ids of plain text, without BOS/EOS added by the tokenizer."""
    return as_token_list(tokenizer.encode(text, add_special_tokens=False))
