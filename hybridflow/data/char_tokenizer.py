"""A character-level tokenizer with a chat template, for tiny models on synthetic tasks.

One token per character plus a few special tokens. The chat layout is

    <|user|>23+45=<|eos|><|assistant|>68<|eos|>

every turn opens with its role token and ends with `<|eos|>`, so the generation engine
stops on the same id that closes a turn. The interface mirrors the parts of a Hugging
Face tokenizer the project uses (`apply_chat_template`, `encode`, `decode`,
`pad_token_id`, `eos_token_id`, `save_pretrained` / `from_pretrained`).
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|pad|>", "<|eos|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>")
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
ARITHMETIC_CHARS = "0123456789+-*/=#() "
PRINTABLE_CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
CONFIG_NAME = "hybridflow_char_tokenizer.json"


class CharTokenizer:
    """Maps each character of `chars` to one id; ids 0..5 are the special tokens."""

    def __init__(self, chars: str = PRINTABLE_CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: `chars` holds duplicate characters")
        self.chars = chars
        self.id_to_token = list(SPECIAL_TOKENS) + list(chars)
        self.token_to_id = {token: index for index, token in enumerate(self.id_to_token)}
        self.pad_token_id = self.token_to_id["<|pad|>"]
        self.eos_token_id = self.token_to_id["<|eos|>"]
        self.unk_token_id = self.token_to_id["<|unk|>"]
        self.pad_token, self.eos_token = "<|pad|>", "<|eos|>"

    @classmethod
    def for_arithmetic(cls) -> CharTokenizer:
        """The smallest vocabulary that covers the `arithmetic` task (25 tokens)."""
        return cls(ARITHMETIC_CHARS)

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False, **_: Any) -> list[int]:
        """One id per character; characters outside the alphabet map to `<|unk|>`."""
        return [self.token_to_id.get(char, self.unk_token_id) for char in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **_: Any) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        pieces = []
        for token_id in ids:
            token = self.id_to_token[int(token_id)]
            if skip_special_tokens and int(token_id) < len(SPECIAL_TOKENS):
                continue
            pieces.append(token)
        return "".join(pieces)

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True):
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **_: Any,
    ) -> list[int] | str:
        """Render chat messages; with `add_generation_prompt` end with `<|assistant|>`."""
        ids: list[int] = []
        for message in messages:
            role = message["role"]
            if role not in ROLE_TOKENS:
                raise ValueError(f"CharTokenizer: unsupported role {role!r}")
            ids.append(self.token_to_id[ROLE_TOKENS[role]])
            ids.extend(self.encode(message["content"]))
            ids.append(self.eos_token_id)
        if add_generation_prompt:
            ids.append(self.token_to_id["<|assistant|>"])
        return ids if tokenize else self.decode(ids, skip_special_tokens=False)

    def save_pretrained(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"type": "char", "chars": self.chars}))
        return path

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> CharTokenizer:
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no CharTokenizer saved in {directory}")
        return cls(json.loads(path.read_text())["chars"])
