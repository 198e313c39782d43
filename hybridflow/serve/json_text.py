"""Text a JSON body decodes to that is no Unicode: lone UTF-16 surrogates.

JSON escapes characters outside the BMP as a surrogate pair ("\\ud83d\\ude00"), which
json.loads makes one character; an unpaired escape ("\\ud800") decodes to a lone surrogate,
which no tokenizer or UTF-8 encoder takes (it was a 500 from the tokenizer). A request
holding one is refused with a 400 naming where.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(body: Any) -> tuple[str, int, str] | None:
    """(where, character index, the character) of a lone surrogate in any string or key of a
    decoded JSON value, else None; where is a path like "messages[0].content"."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            found = None if value.isascii() else _SURROGATE.search(value)
            if found:
                return where, found.start(), found.group()
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((f"{where}.{key}" if where else str(key), item))
                stack.append((f"{where} (a key)" if where else "a key", key))
        elif isinstance(value, list):
            stack.extend((f"{where}[{index}]", item) for index, item in enumerate(value))
    return None


def surrogate_message(where: str, position: int, character: str) -> str:
    """What a 400 for a lone surrogate says (`lone_surrogate`'s answer)."""
    return (
        f"{where or 'the request body'} holds a lone UTF-16 surrogate "
        f"({character.encode('unicode_escape').decode()} at character {position}), which "
        "is no Unicode text: escape characters outside the BMP as a surrogate pair "
        "(\\ud83d\\ude00) or send them as UTF-8"
    )
