"""`hybridflow train` of tiny-moe on two CPU processes with rollout.release_weights: the
engine's own weight copy freed after each step's generation and rewritten by the sync logs
the metrics and samples the tokens of the same model's run without it, step after step."""

from __future__ import annotations

import pytest
from rollout_layout_helpers import PLAIN, assert_same, read_samples, train_run

MOE = ("model.path=tiny-moe",)
RELEASE = "rollout.release_weights=true"
# the pattern `config plan` recommends for DeepSeek-V3 on 128 × 96 GB: the rollout's experts
# over its replicas, the actor's expert shards and AdamW state on the host, the copy freed
SPREAD = ("rollout.expert_parallel_size=2", "actor.expert_parallel_size=2",
          "critic.expert_parallel_size=1", "actor.param_offload=true")  # fmt: skip


@pytest.mark.slow
def test_released_rollout_weights_log_the_metrics_of_kept_ones(tmp_path):
    """Data parallel (each process's engine loads the FSDP2 actor's gathered tensors) and the
    experts spread over two rollout replicas (the reshard from expert-parallel shards): the
    metrics and samples of data parallelism with the weights kept, and every step frees the
    engine's weights."""
    kept = train_run(tmp_path / "kept", *PLAIN, *MOE)
    released = {
        "dp": train_run(tmp_path / "dp", *PLAIN, *MOE, RELEASE),
        "spread": train_run(tmp_path / "spread", *MOE, *SPREAD, RELEASE),
    }
    for name, run in released.items():
        assert kept.keys() == run.keys() == {1, 2}
        for step, want in kept.items():
            assert run[step]["perf/rollout_weights_released_gb"] > 0, (name, step)
            assert_same(want, run[step], step)
            assert read_samples(tmp_path / "kept", step) == read_samples(tmp_path / name, step)
