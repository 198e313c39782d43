"""The synchronous step scores its responses on the controller while the first forward pass
runs on its group (trainer/rl_loop.score_beside): the reward starts before the pass ends,
the pass's columns and the scores land in one batch, the stages are timed in pieces, and a
reward that fails lets the pass finish before its error goes up."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.rewards.managers import RewardResult
from hybridflow.trainer.loop.rl_loop import score_beside
from hybridflow.trainer.observe.metrics import Timer


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


class Reward:
    """Scores each text by its length; sets `started` first, then fails if told to."""

    def __init__(self, fail: bool = False):
        self.started, self.fail = threading.Event(), fail

    def score(self, texts, ground_truths, sources, extras, response_lengths=None):
        self.started.set()
        if self.fail:
            raise RuntimeError("the reward function failed")
        return RewardResult([float(len(t)) for t in texts], {"reward/mean": 1.0})


class PassBesideReward:
    """A group method whose pass ends only once the reward has started (a reward that ran
    after the pass would find it stuck): .remote() runs it on a thread."""

    def __init__(self, reward: Reward):
        self.reward, self.group = reward, SimpleNamespace(call_timeout_s=30)
        self.finished = threading.Event()

    def remote(self, batch: Batch):
        future = Future()

        def run():
            beside = self.reward.started.wait(timeout=10)
            future_value = Batch({"old_logprobs": torch.full((len(batch), 3), float(beside))})
            self.finished.set()
            future.set_result(future_value)

        threading.Thread(target=run, daemon=True).start()
        return SimpleNamespace(get=lambda timeout: future.result(timeout))


def _batch() -> Batch:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return Batch(
        {"responses": torch.tensor([[0, 1, 2], [3, 4, 5]]), "response_mask": mask},
        {"ground_truth": np.array(["", ""], dtype=object),
         "data_source": np.array(["t", "t"], dtype=object),
         "extra_info": np.array([{}, {}], dtype=object)},
    )  # fmt: skip


def _run(reward: Reward):
    return SimpleNamespace(tokenizer=CharTokenizer(), reward=reward, reward_monitor=None,
                           step=1, reward_weights={"*": {"rule": 1.0}}, progress=SimpleNamespace(set_status=lambda stage: None))  # fmt: skip


def test_the_reward_runs_while_the_first_pass_is_in_flight():
    reward = Reward()
    method = PassBesideReward(reward)
    timer = Timer()
    batch, metrics = score_beside(_run(reward), timer, "old_logprob", method, _batch())
    assert bool(batch.tensors["old_logprobs"].all())  # the pass saw the reward start
    assert batch.arrays["scores"].tolist() == [2.0, 3.0]
    assert batch.tensors["token_level_scores"][1, 2] == 3.0  # on the last response token
    assert metrics == {"reward/mean": 1.0}
    assert set(timer.seconds) == {"old_logprob", "reward"}


def test_a_failing_reward_lets_the_pass_finish_before_its_error_goes_up():
    reward = Reward(fail=True)
    method = PassBesideReward(reward)
    with pytest.raises(RuntimeError, match="the reward function failed"):
        score_beside(_run(reward), Timer(), "old_logprob", method, _batch())
    assert method.finished.is_set()
