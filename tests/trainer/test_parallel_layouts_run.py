"""`hybridflow train` on two CPU processes with the roles in different layouts at once, the
actor tensor-parallel (TP = 2) beside a reference and a critic in Ulysses sequence
parallelism (SP = 2), logs the metrics of plain data parallelism on the same two processes:
the same samples, rewards, losses and gradient norms, step after step (the updated weights
sample the next step's responses). Every role's metrics are compared, so one run checks both
layouts against data parallelism (tests/trainer/test_rollout_tensor_parallel_run.py runs the
actor in SP; tests/learners/test_layouts_cpu.py checks each role in each layout)."""

from __future__ import annotations

import math

import pytest
from trainer_helpers import CLOCKED, read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import train

# Two mini-batches a step (16 samples, 8 a mini-batch): which samples share one is part of
# what must match data parallelism.
RUN = ["trainer.backend=local", "trainer.n_gpus_per_node=2", "actor.use_kl_loss=true",
       "algorithm.adv_estimator=gae", "trainer.save_freq=0", "data.val_files=[]",
       "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
       "actor.micro_batch_size_per_gpu=4", "critic.micro_batch_size_per_gpu=4"]  # fmt: skip
# The reference's log-probs reach the metrics through actor/kl_loss, the critic's values
# through critic/* and the advantages (GAE) the actor trains on.
MIXED = ["actor.tensor_parallel_size=2",
         "ref.tensor_parallel_size=1", "ref.sequence_parallel_size=2",
         "critic.tensor_parallel_size=1", "critic.sequence_parallel_size=2"]  # fmt: skip
NOT_COMPARED = ("timing_s/", "perf/", "memory/", *CLOCKED)  # wall-clock and host measurements


def _run(tmp_path, *overrides):
    cfg = tiny_config(tmp_path, *RUN, *overrides)
    train(cfg, log=lambda *args, **kwargs: None)
    return read_metrics(cfg.trainer.run_dir)


@pytest.mark.slow
def test_tensor_and_sequence_parallel_roles_log_the_metrics_of_data_parallel(tmp_path):
    data_parallel = _run(tmp_path / "dp")
    layout = _run(tmp_path / "mixed", *MIXED)
    assert data_parallel.keys() == layout.keys() == {1, 2}
    for step, want in data_parallel.items():
        compared = [k for k, v in want.items()
                    if isinstance(v, float) and not k.startswith(NOT_COMPARED)]  # fmt: skip
        assert {"actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss",
                "critic/grad_norm"} <= set(compared), sorted(compared)  # fmt: skip
        for key in compared:
            got = layout[step][key]
            if math.isnan(want[key]):
                assert math.isnan(got), ("actor TP, ref and critic SP", step, key)
            else:
                assert got == pytest.approx(want[key], rel=1e-3, abs=1e-6), (
                    "actor TP, ref and critic SP", step, key)  # fmt: skip
