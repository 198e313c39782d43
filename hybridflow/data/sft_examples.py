"""Supervised fine-tuning data: reading, tokenising with a response-only loss mask, packing.

Two row layouts are accepted (parquet or jsonl):
  - prompt/response: `{"prompt": [chat messages] or "text", "response": "text"}`
  - chat messages:   `{"messages": [{"role", "content"}, ...]}` (loss on assistant turns)

`loss_mask[t] == 1` marks tokens the model must learn to produce: with the usual shift,
the loss at position t-1 predicts `input_ids[t]` and counts when `loss_mask[t]` is 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.data.char_limits import char_limit, text_chars
from hybridflow.data.chat import ChatTokenizer, as_token_list, encode_chat_prompt, encode_text
from hybridflow.data.schema import DataSchemaError, check_text, iter_rows, validate_messages
from hybridflow.errors import UserError


@dataclass(frozen=True)
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]
    """1 on response tokens (targets), 0 on prompt tokens; same length as input_ids."""


def validate_sft_row(row: Any, where: str) -> list[dict[str, str]] | tuple[list, str]:
    """Return chat messages (messages layout) or `(prompt_messages, response)`."""
    if not isinstance(row, dict):
        raise DataSchemaError(f"{where}: row must be an object, got {type(row).__name__}")
    if row.get("messages") is not None:
        messages = validate_messages(row["messages"], where, "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataSchemaError(f"{where}: key 'messages' holds no assistant turn to learn")
        return messages
    for key in ("prompt", "response"):
        if row.get(key) is None:
            raise DataSchemaError(
                f"{where}: missing key '{key}'; an SFT row needs 'prompt' and 'response', "
                f"or 'messages' (present: {sorted(row)})"
            )
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    prompt = validate_messages(prompt, where, "prompt")
    if not isinstance(row["response"], str):
        raise DataSchemaError(f"{where}: key 'response' must be a string")
    return prompt, check_text(row["response"], where, "response")


def iter_sft_rows(paths: str | Path | Sequence[str | Path]) -> Iterator[Any]:
    """Each validated SFT row of one or more files, as it is read."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for path in paths:
        for where, row in iter_rows(path):
            yield validate_sft_row(row, where)


def load_sft_rows(paths: str | Path | Sequence[str | Path]) -> list[Any]:
    """Read and validate SFT rows from one or more files."""
    return list(iter_sft_rows(paths))


def sft_row_chars(row: Any) -> int:
    """Characters of a validated row's text: the messages' contents (and the response)."""
    return text_chars(row[0], row[1]) if isinstance(row, tuple) else text_chars(row)


def tokenize_prompt_response(
    tokenizer: ChatTokenizer, prompt: Sequence[dict[str, str]], response: str, eos_token_id: int
) -> SFTExample:
    """Chat-templated prompt (no loss) + response + EOS (loss)."""
    prompt_ids = encode_chat_prompt(tokenizer, prompt)
    response_ids = encode_text(tokenizer, response) + [eos_token_id]
    return SFTExample(
        input_ids=prompt_ids + response_ids,
        loss_mask=[0] * len(prompt_ids) + [1] * len(response_ids),
    )


def tokenize_messages(tokenizer: ChatTokenizer, messages: Sequence[dict[str, str]]) -> SFTExample:
    """Loss on every assistant turn; its span is found as the difference between the
    template of the conversation up to that turn and the template that opens the turn."""
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        opener = encode_chat_prompt(tokenizer, messages[:turn])
        closed = as_token_list(
            tokenizer.apply_chat_template(
                [dict(m) for m in messages[: turn + 1]], add_generation_prompt=False, tokenize=True
            )
        )
        if closed[: len(input_ids)] != input_ids or closed[: len(opener)] != opener:
            raise UserError(
                "the tokenizer's chat template does not render conversations as extensions "
                "of their prefixes",
                "use the prompt/response layout for this tokenizer",
            )
        loss_mask += [0] * (len(opener) - len(input_ids)) + [1] * (len(closed) - len(opener))
        input_ids = closed
    return SFTExample(input_ids=input_ids, loss_mask=loss_mask)


def tokenize_sft_rows(
    rows: Iterable[Any], tokenizer: ChatTokenizer, eos_token_id: int, max_length: int | None = None
) -> tuple[list[SFTExample], int]:
    """Tokenise validated rows as they come; returns (examples, number dropped for exceeding
    `max_length`). A row with more characters than `max_length` tokens can stand for is
    dropped untokenized (char_limits.py), so `rows` may be a stream read from disk."""
    chars_at_most = char_limit(tokenizer, max_length)
    examples, dropped = [], 0
    for row in rows:
        if chars_at_most is not None and sft_row_chars(row) > chars_at_most:
            dropped += 1
            continue
        if isinstance(row, tuple):
            example = tokenize_prompt_response(tokenizer, row[0], row[1], eos_token_id)
        else:
            example = tokenize_messages(tokenizer, row)
        if max_length is not None and len(example.input_ids) > max_length:
            dropped += 1
            continue
        examples.append(example)
    return examples, dropped


def pack_examples(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group example indices into packs of at most `max_tokens` tokens, in order.

    Greedy and order-preserving, so packing is deterministic given the sampler's order.
    """
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(f"example {index} has {length} tokens > max_tokens={max_tokens}")
        if used + length > max_tokens and current:
            packs.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        packs.append(current)
    return packs


def collate_packed(examples: Sequence[SFTExample]) -> dict[str, Any]:
    """Concatenate examples into one packed row.

    Returns `input_ids`, `loss_mask`, `position_ids` (restart at 0 per example), each
    [1, T] int64, and `cu_seqlens` [n + 1] int32 (sequence boundaries for varlen attention).
    """
    import torch

    input_ids, loss_mask, position_ids, boundaries = [], [], [], [0]
    for example in examples:
        input_ids += example.input_ids
        loss_mask += example.loss_mask
        position_ids += list(range(len(example.input_ids)))
        boundaries.append(boundaries[-1] + len(example.input_ids))
    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "loss_mask": torch.tensor([loss_mask], dtype=torch.long),
        "position_ids": torch.tensor([position_ids], dtype=torch.long),
        "cu_seqlens": torch.tensor(boundaries, dtype=torch.int32),
    }
