"""Token limits applied before tokenizing: a text too long for the limit in any tokenization
is dropped (or cut) by its character count, as it is read.

Tokenizing costs far more memory than the text: a 100 MB prompt took `train` to 6.6 GB and
an abort before it could be found longer than data.max_prompt_length. A token stands for at
most `max_chars_per_token(tokenizer)` characters, so a text of more than
`max_tokens * max_chars_per_token` characters has more than `max_tokens` tokens, and only
such a text is dropped untokenized; every other one is tokenized and measured as before.

Why the bound holds (no text within a limit is dropped by it):

- A token's string in the vocabulary is at least as long as the text it stands for. A
  byte-level BPE vocabulary (GPT-2, Llama 3, Qwen) spells each byte as one character, and a
  character is at least one byte; a SentencePiece piece spells a space as one "▁"; byte
  fallback pieces ("<0xE3>") and WordPiece's "##" are longer than what they stand for;
  special tokens are matched as their own text. So the longest entry, L, bounds it.
- Normalizers can shorten the text before it is split: NFC/NFKC compose at most 4
  characters into one (the longest canonical decomposition, e.g. U+1F84 = alpha with three
  marks), and lower-casing never shortens. Hence `UNICODE_COMPOSITION` x L.
- Not covered: a tokenizer that throws characters away (WordPiece splitting on whitespace,
  T5's collapsing of whitespace runs, fused unknown characters) could give a prompt more
  than 4 L characters a token; no chat model's tokenizer does, and such a text is mostly
  what the tokenizer discards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

UNICODE_COMPOSITION = 4
"""The most characters Unicode normalization (NFC/NFKC) composes into one."""


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token of `tokenizer` can stand for (module
    docstring); None when the tokenizer has no vocabulary to read (no bound: texts are
    tokenized whatever their length)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocabulary = get_vocab()
    except (NotImplementedError, AttributeError, TypeError):
        return None
    longest = max((len(token) for token in vocabulary if isinstance(token, str)), default=0)
    return UNICODE_COMPOSITION * longest if longest else None


def char_limit(tokenizer: Any, max_tokens: int | None) -> int | None:
    """Characters past which a text has more than `max_tokens` tokens; None: no limit."""
    per_token = max_chars_per_token(tokenizer) if max_tokens is not None else None
    return None if per_token is None else max_tokens * per_token


def text_chars(messages: Sequence[dict[str, str]], *texts: str) -> int:
    """Characters of the messages' contents and of `texts` (what the template wraps)."""
    return sum(len(message["content"]) for message in messages) + sum(map(len, texts))


def keep_last_chars(messages: Sequence[dict[str, str]], limit: int) -> list[dict[str, str]]:
    """The end of the conversation, `limit` characters of content at most: earlier messages
    dropped, the first one kept cut from its start. For left truncation with twice the
    `char_limit`: the last `max_tokens` tokens of the whole stand for at most half of what
    is kept, so the tokens cut this way would have been cut anyway (the cut changes the
    tokens next to it only, far to the left of those kept)."""
    kept: list[dict[str, str]] = []
    left = limit
    for message in reversed(messages):
        if left <= 0:
            break
        content = message["content"]
        kept.append({**message, "content": content[-left:] if len(content) > left else content})
        left -= len(content)
    return kept[::-1]
