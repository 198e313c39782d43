"""Generated token ids -> the text a client gets: per-token pieces, stop strings, the tokens
that text covers.

The engine stops on token ids only. A stop string is applied here: the text is cut where the
first stop string to complete ends (and the stop string itself is dropped, as OpenAI does),
and the tokens after the one that completed it are dropped too, as if the engine had stopped
there; the finish reason becomes "stop". A stop token the engine stopped on (eos, a
`stop_token_ids` entry, a single-token stop string) is kept in the token ids and left out of
the text.
"""

from __future__ import annotations

from dataclasses import dataclass


class PieceDecoder:
    """Incremental decoding: push(token id) -> the text that token adds ("" while a
    character split over several byte tokens is unfinished, then the whole character on
    its last token). A window of the last few tokens is decoded, never the whole text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the decoded context of the next piece
        self.before = ""

    def _decode(self, part) -> str:
        return self.tokenizer.decode(part, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(self.before) and not after.endswith("\ufffd"):
            piece = after[len(self.before) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.before = self._decode(self.ids[self.prefix : self.read])
            return piece
        return ""

    def trailing(self) -> str:
        """At the end: an unfinished character's replacement text (else "")."""
        if self.read < len(self.ids):
            return self._decode(self.ids[self.prefix :])[len(self.before) :]
        return ""


def token_pieces(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """The text each token adds, by incremental decoding (PieceDecoder: a character
    split over several byte tokens comes out whole, on its last token): the pieces joined are
    the decoded text."""
    decoder = PieceDecoder(tokenizer, skip_special_tokens)
    pieces = [decoder.push(token_id) for token_id in ids]
    if pieces:  # an unfinished character at the end: its replacement text
        pieces[-1] += decoder.trailing()
    return pieces


@dataclass
class Output:
    """One choice as the client sees it."""

    text: str
    token_ids: list[int]
    """The tokens the text covers: through the one that completed a stop string, or all."""
    logprobs: list[float]
    finish_reason: str
    pieces: list[str]
    """Per token in token_ids: its part of `text` (cut at the end of text: "" past it)."""
    offsets: list[int]
    """Per token: where its piece starts in `text`."""
    tokens: list[str]
    """Per token: its string for the logprobs fields (the piece, or the token's own
    spelling for special tokens and pieces of a split character)."""


def finish_output(tokenizer, token_ids: list[int], logprobs: list[float], finish_reason: str,
                  stops: list[str], skip_special_tokens: bool = True) -> Output:  # fmt: skip
    """Text, kept tokens and finish reason of one engine completion (module docstring)."""
    ids, lps = list(token_ids), list(logprobs)
    pieces = token_pieces(tokenizer, ids, skip_special_tokens)
    visible = len(ids) - 1 if finish_reason == "stop" and ids else len(ids)
    offsets, position = [], 0
    for piece in pieces:
        offsets.append(position)
        position += len(piece)
    full = "".join(pieces[:visible])
    keep, text = len(ids), full
    best = None  # (end, start) of the stop string that completes first
    for stop in stops:
        start = full.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best):
            best = (start + len(stop), start)
    if best is not None:
        end, start = best
        text, finish_reason = full[:start], "stop"
        keep = next(k for k in range(visible) if offsets[k] + len(pieces[k]) >= end) + 1
    shown = [text[offsets[k] : offsets[k] + len(pieces[k])] for k in range(keep)]
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    tokens = [
        pieces[k] if pieces[k] and ids[k] not in special else _spelling(tokenizer, ids[k])
        for k in range(keep)
    ]
    return Output(text, ids[:keep], lps[:keep], finish_reason, shown,
                  [min(offsets[k], len(text)) for k in range(keep)], tokens)  # fmt: skip


def _spelling(tokenizer, token_id: int) -> str:
    try:
        token = tokenizer.convert_ids_to_tokens(int(token_id))
    except Exception:  # a tokenizer without the method or an id it does not know
        token = None
    return token if isinstance(token, str) else f"<token {token_id}>"
