"""Drafts from n-gram matches (speculative/drafts.py): the index against a literal scan,
the longest match first, sources in order, and the store's bounds."""

from __future__ import annotations

import random

from hybridflow.engine.speculative.drafts import DraftStore, NgramIndex, propose


def _scan(tokens, ngram, k):
    """Literal reference: the tokens after the LAST occurrence of ngram followed by a token."""
    n = len(ngram)
    for start in range(len(tokens) - n - 1, -1, -1):
        if tuple(tokens[start : start + n]) == ngram:
            return tokens[start + n : start + n + k]
    return []


def test_index_finds_the_latest_occurrence_like_a_scan():
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(300)]
    index = NgramIndex(1, 3)
    for piece in (tokens[:7], tokens[7:150], tokens[150:]):  # grown in pieces
        index.extend(piece)
    for n in (1, 2, 3):
        for start in range(0, 290, 7):
            ngram = tuple(tokens[start : start + n])
            assert index.continuation(ngram, 4) == _scan(tokens, ngram, 4)


def test_the_suffix_itself_is_no_match():
    index = NgramIndex(2, 2, [1, 2, 3])
    assert index.continuation((2, 3), 4) == []  # nothing follows its only occurrence
    assert index.continuation((1, 2), 4) == [3]


def test_propose_prefers_the_longest_suffix_then_the_first_source():
    context = [9, 1, 2, 3]
    short = NgramIndex(1, 3, [3, 7, 7, 7])  # matches the 1-gram (3,)
    long = NgramIndex(1, 3, [1, 2, 3, 8, 8])  # matches the 3-gram (1, 2, 3)
    assert propose(context, [short, long], k=2, min_n=1, max_n=3) == [8, 8]
    first = NgramIndex(1, 3, [2, 3, 5])
    second = NgramIndex(1, 3, [2, 3, 6])
    assert propose(context, [first, second], k=4, min_n=1, max_n=3) == [5]
    assert propose(context, [second, first], k=4, min_n=1, max_n=3) == [6]
    assert propose(context, [first], k=0, min_n=1, max_n=3) == []
    assert propose(context, [NgramIndex(2, 3, [4, 4])], k=4, min_n=2, max_n=3) == []


def test_self_repetition_drafts_the_loop():
    loop = [4, 5, 6, 7]
    sequence = loop * 3
    index = NgramIndex(2, 3, sequence)
    assert propose(sequence, [index], k=6, min_n=2, max_n=3) == [4, 5, 6, 7]  # up to the end


def test_store_keeps_the_newest_rollouts_within_its_token_budget():
    store = DraftStore(max_tokens=8, rollouts_per_prompt=2, min_n=1, max_n=2)
    store.add([1], [10, 11, 12])
    store.add([1], [20])
    store.add([1], [30])  # a third response of [1]: its oldest goes
    assert [r.tokens for r in store.rollouts([1])] == [[1, 30], [1, 20]]  # prompt's tail first
    store.add([2], [40, 41])
    store.add([1], [50])  # [2] is now the prompt added to least recently
    assert store.tokens == 7
    store.add([3], [60])  # 9 tokens: [2]'s response goes
    assert store.rollouts([2]) == [] and len(store) == 2 and store.tokens == 6
    store.add([4], list(range(100, 120)))  # cut to the budget; everything else goes
    assert [r.tokens for r in store.rollouts([4])] == [[4, *range(100, 107)]]
    assert store.rollouts([1]) == [] and store.tokens == 8
    assert store.rollouts([5]) == []


def test_a_stored_rollout_drafts_what_followed_across_the_prompt_end():
    store = DraftStore(max_tokens=100, rollouts_per_prompt=4, min_n=2, max_n=3)
    prompt = [7, 8, 9]
    store.add(prompt, [1, 2, 3, 4, 5])
    # the new sample has produced nothing yet: its context ends with the prompt
    assert propose(prompt, store.rollouts(prompt), k=3, min_n=2, max_n=3) == [1, 2, 3]
    assert propose(prompt + [1, 2], store.rollouts(prompt), k=2, min_n=2, max_n=3) == [3, 4]


def test_an_empty_or_disabled_store_holds_nothing():
    store = DraftStore(max_tokens=0, rollouts_per_prompt=4, min_n=2, max_n=3)
    store.add([1], [2, 3])
    assert len(store) == 0
    store = DraftStore(max_tokens=10, rollouts_per_prompt=4, min_n=2, max_n=3)
    store.add([1], [])
    assert len(store) == 0
