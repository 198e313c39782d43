"""`hybridflow train` on two CPU processes in a rollout layout against plain data parallelism:
the runs, verl's keys they share, and the comparison of their metrics and samples."""

from __future__ import annotations

import json
import math

import pytest
from trainer_helpers import CLOCKED, TINY

from hybridflow.cli import main

VERL = "actor_rollout_ref."
# verl's own keys (the local backend follows from 2 devices on one node; "file" is our
# metrics.jsonl); the tiny model and data are ours (trainer_helpers.TINY)
RUN = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", VERL + "actor.use_kl_loss=True",
       "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False",
       "trainer.logger=['console','file']"]  # fmt: skip
NOT_COMPARED = ("timing_s/", "perf/", "memory/", *CLOCKED)  # wall-clock and host measurements


PLAIN = (VERL + "rollout.tensor_model_parallel_size=1",)
# The dense model's reference where data parallelism over the two processes is not itself in
# question: the same run in this process, without starting two (it logs what data
# parallelism logs: test_rollout_tensor_parallel_run.py's first test). Not for
# mixture-of-experts runs: their router statistics (aux loss, expert load) are per rank.
ONE_PROCESS = (*PLAIN, "trainer.backend=inprocess", "trainer.n_gpus_per_node=1")
LAYOUT = (VERL + "actor.ulysses_sequence_parallel_size=2",
          VERL + "rollout.tensor_model_parallel_size=2")  # fmt: skip


def train_run(tmp_path, *layout: str) -> dict[int, dict]:
    run_dir = tmp_path / "run"
    argv = ["train", *TINY, *RUN, *layout, f"trainer.run_dir={run_dir}",
            f"trainer.cache_dir={tmp_path / 'cache'}",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}"]  # fmt: skip
    assert main(argv) == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def read_samples(tmp_path, step: int) -> list[dict]:
    """The step's samples as verl's trainer.rollout_data_dir writes them (text and score),
    sorted: the file follows the order the ranks train the rows in, balanced by length over
    the data-parallel ranks, which differs between 1 and 2 of them."""
    lines = (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda row: json.dumps(row))


def assert_same(want: dict, got: dict, step: int) -> None:
    compared = [k for k, v in want.items()
                if isinstance(v, float) and not k.startswith(NOT_COMPARED)]  # fmt: skip
    assert {"actor/pg_loss", "actor/grad_norm", "score/mean", "critic/vf_loss",
            "response_length/mean"} <= set(compared)  # fmt: skip
    for key in compared:
        if math.isnan(want[key]):
            assert math.isnan(got[key]), (step, key)
        else:
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-6), (step, key)
