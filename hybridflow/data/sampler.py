"""A deterministic, resumable sampler of dataset indices.

Epoch `e` visits the items in the order `permutation(seed, e)`, a pure function of the
seed and the epoch number, so the whole stream of batches is fixed by the seed. The
state is just `(epoch, position)`: after `load_state_dict` the sampler continues with
exactly the batch it would have produced next, which is what checkpoint resume needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridflow.config import ConfigError


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Index order of one epoch; `np.random.default_rng([seed, epoch])` keeps epochs independent."""
    if not shuffle:
        return np.arange(num_items)
    return np.random.default_rng([seed, epoch]).permutation(num_items)


class ResumableSampler:
    """Yields batches of indices; an epoch's tail shorter than a batch is dropped.

    Dropping the tail (rather than mixing two epochs in one batch) keeps every batch
    the same size and every epoch a permutation.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_items <= 0:
            raise ValueError("ResumableSampler: the dataset is empty")
        if not 0 < batch_size <= num_items:
            raise ConfigError(
                [
                    f"ResumableSampler: batch_size={batch_size} must be in [1, {num_items}] "
                    f"(the dataset holds {num_items} prompts); lower data.train_batch_size"
                ]
            )
        self.num_items, self.batch_size = num_items, batch_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = epoch_order(num_items, seed, 0, shuffle)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_items // self.batch_size

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices, starting a new epoch when this one runs out."""
        if self.position + self.batch_size > self.num_items:
            self._start_epoch(self.epoch + 1)
        start = self.position
        self.position += self.batch_size
        return self._order[start : self.position].tolist()

    def __iter__(self):
        while True:
            yield self.next_batch()

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0
        self._order = epoch_order(self.num_items, self.seed, epoch, self.shuffle)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; refuses a state taken on a different dataset or seed."""
        for key in ("seed", "num_items", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"ResumableSampler: checkpoint has {key}={state[key]!r} but the current "
                    f"run has {key}={getattr(self, key)!r}; resume with the same data and seed"
                )
        self.batch_size = int(state.get("batch_size", self.batch_size))
        self._start_epoch(int(state["epoch"]))
        self.position = int(state["position"])
