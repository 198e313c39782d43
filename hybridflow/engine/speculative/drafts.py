"""Draft tokens that need no second model: n-gram matches in the prompt, in the sequence
itself and in earlier rollouts of the same prompt (prompt lookup decoding; SPEC-RL and
RhymeRL draft from earlier rollouts of a prompt, which in RL are many: the group's siblings
and every earlier epoch's samples).

A draft is a guess: the verifier (acceptance.py) keeps the sampling distribution exact
whatever it proposes, so a bad draft costs only the verify pass's extra positions.

    index = NgramIndex(min_n=2, max_n=4)
    index.extend(prompt + tokens)                      # grows with the sequence
    draft = propose(prompt + tokens, [index, *store.rollouts(prompt)], k=4, min_n=2, max_n=4)

The indexes map each n-gram to where its latest occurrence is followed by a token, so a
lookup costs a dict access per n, not a scan of the sequence (a 2k-token context and eight
siblings scanned in Python per step would cost more than the decode step it saves).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class NgramIndex:
    """A token sequence with, for every n in [min_n, max_n], each n-gram's latest occurrence
    that a token follows: n-gram -> position of that following token."""

    __slots__ = ("tokens", "min_n", "max_n", "table")

    def __init__(self, min_n: int, max_n: int, tokens: Sequence[int] = ()):
        self.tokens: list[int] = []
        self.min_n, self.max_n = min_n, max_n
        self.table: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; each registers the n-grams that end just before it."""
        seq, table = self.tokens, self.table
        for token in tokens:
            follow = len(seq)
            for n in range(self.min_n, min(self.max_n, follow) + 1):
                table[tuple(seq[follow - n : follow])] = follow
            seq.append(int(token))

    def continuation(self, ngram: tuple[int, ...], k: int) -> list[int]:
        """Up to k tokens that followed the latest occurrence of `ngram` ([] if none)."""
        follow = self.table.get(ngram)
        if follow is None:
            return []
        return self.tokens[follow : follow + k]


def propose(context: Sequence[int], sources: Sequence[NgramIndex], k: int, min_n: int,
            max_n: int) -> list[int]:  # fmt: skip
    """Up to k draft tokens to follow `context`: what followed the longest suffix of it (n
    from max_n down to min_n) in the first source holding that suffix with a continuation.
    Sources in order of trust (earlier rollouts of the prompt, then the sequence itself)."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        suffix = tuple(context[len(context) - n :])
        for source in sources:
            draft = source.continuation(suffix, k)
            if draft:
                return draft
    return []


class DraftStore:
    """Earlier responses per prompt, bounded in tokens: the latest `rollouts_per_prompt`
    responses of each prompt, and at most `max_tokens` tokens in all (the oldest response of
    the prompt added to least recently goes first). So its memory is bounded whatever the
    workload: the group's siblings that finished, and earlier epochs' samples of the prompt.

    A response is indexed when first looked up, not when added: every finished request is
    added, and only those whose prompt still has a row decoding in the tail are read."""

    def __init__(self, max_tokens: int, rollouts_per_prompt: int, min_n: int, max_n: int):
        self.max_tokens, self.rollouts_per_prompt = max_tokens, rollouts_per_prompt
        self.min_n, self.max_n = min_n, max_n
        # prompt -> its responses, oldest first: token lists, or their indexes once read
        self._prompts: OrderedDict[tuple[int, ...], deque[list[int] | NgramIndex]] = OrderedDict()
        self.tokens = 0  # tokens held (responses, and the prompt tails indexed with them)

    def __len__(self) -> int:
        return len(self._prompts)

    def add(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        """A finished response of `prompt`, kept with the prompt's last max_n - 1 tokens
        before it (a match may span the prompt's end)."""
        if self.max_tokens <= 0 or self.rollouts_per_prompt <= 0 or not response:
            return
        key = tuple(prompt)
        rollouts = self._prompts.get(key)
        if rollouts is None:
            rollouts = self._prompts[key] = deque()
        self._prompts.move_to_end(key)
        tail = list(prompt[len(prompt) - (self.max_n - 1) :]) if self.max_n > 1 else []
        kept = tail + list(response[: self.max_tokens - len(tail)])
        rollouts.append(kept)
        self.tokens += len(kept)
        if len(rollouts) > self.rollouts_per_prompt:
            self._drop_oldest(key)
        while self.tokens > self.max_tokens:
            self._drop_oldest(next(iter(self._prompts)))

    def _drop_oldest(self, key: tuple[int, ...]) -> None:
        rollouts = self._prompts[key]
        self.tokens -= len(rollouts.popleft())
        if not rollouts:
            del self._prompts[key]

    def rollouts(self, prompt: Sequence[int]) -> list[NgramIndex]:
        """The stored responses of `prompt` as indexes, newest first ([] if none)."""
        rollouts = self._prompts.get(tuple(prompt))
        if not rollouts:
            return []
        for i, rollout in enumerate(rollouts):
            if not isinstance(rollout, NgramIndex):
                rollouts[i] = NgramIndex(self.min_n, self.max_n, rollout)
        return list(reversed(rollouts))
