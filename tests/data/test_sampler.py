"""Resumable sampler: reproducible from the seed, exact continuation after resume."""

import pytest

from hybridflow.data.sampler import ResumableSampler


def take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_same_seed_same_order_and_epochs_are_permutations():
    a, b = ResumableSampler(10, 3, seed=7), ResumableSampler(10, 3, seed=7)
    batches = take(a, 9)  # 3 full batches per epoch -> 3 epochs
    assert batches == take(b, 9)
    for epoch in range(3):
        seen = sum(batches[3 * epoch : 3 * epoch + 3], [])
        assert len(set(seen)) == 9  # no repeats inside an epoch; the 10th item is dropped
    assert batches[:3] != batches[3:6]  # each epoch reshuffles
    assert take(ResumableSampler(10, 3, seed=8), 3) != batches[:3]


@pytest.mark.parametrize("stop_after", [1, 3, 4, 7])
def test_resume_continues_exactly(stop_after):
    straight = take(ResumableSampler(11, 4, seed=3), 10)
    first = ResumableSampler(11, 4, seed=3)
    head = take(first, stop_after)
    state = first.state_dict()
    resumed = ResumableSampler(11, 4, seed=3)
    resumed.load_state_dict(state)
    assert head + take(resumed, 10 - stop_after) == straight


def test_no_shuffle_is_in_order():
    assert take(ResumableSampler(5, 2, shuffle=False), 3) == [[0, 1], [2, 3], [0, 1]]


def test_resume_refuses_other_seed_or_dataset():
    state = ResumableSampler(10, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1.*seed=2"):
        ResumableSampler(10, 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_items"):
        ResumableSampler(12, 2, seed=1).load_state_dict(state)


def test_batch_larger_than_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="train_batch_size"):
        ResumableSampler(3, 4)
