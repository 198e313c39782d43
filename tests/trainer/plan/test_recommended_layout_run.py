"""`hybridflow train` runs the layout pattern `config plan` recommends: the keys it picks for
Qwen3-30B-A3B on 8 × 80 GiB (a tensor-parallel rollout, expert parallelism, gradient
checkpointing, the actor's state and expert shards on the host, FSDP2 gathering layer by
layer), applied to tiny-moe on two CPU processes (gloo), rollout tp and actor ep scaled to
them."""

from __future__ import annotations

import pytest
from trainer_helpers import read_metrics, tiny_config

from hybridflow.config import load_config
from hybridflow.trainer.lifecycle.run import train
from hybridflow.trainer.plan.memory_plan import GIB
from hybridflow.trainer.plan.parallel_choice import recommend


@pytest.mark.slow
def test_train_runs_the_recommended_pattern_on_two_cpu_processes(tmp_path):
    cfg = load_config(None, ["model.path=qwen3-30b-a3b", "trainer.n_gpus_per_node=8",
                             "trainer.backend=local", "trainer.device=cuda",
                             "data.max_prompt_length=1024", "data.max_response_length=4096",
                             "data.train_batch_size=128", "actor.ppo_mini_batch_size=32",
                             "actor.max_tokens_per_gpu=16384", "actor.use_kl_loss=true"])  # fmt: skip
    keys = recommend(cfg, 80 * GIB).changes
    assert keys["actor.param_offload"] is True and keys["rollout.tensor_parallel_size"] > 1
    assert keys["actor.expert_parallel_size"] > 1
    keys["rollout.tensor_parallel_size"] = 2  # the pattern, on two processes
    keys["actor.expert_parallel_size"] = 2
    overrides = [f"{key}={str(value).lower()}" for key, value in keys.items()]
    tiny = tiny_config(tmp_path, "model.path=tiny-moe", "trainer.backend=local",
                       "trainer.n_gpus_per_node=2", "trainer.total_steps=1", "trainer.save_freq=0",
                       "data.val_files=[]", "actor.use_kl_loss=true", "rollout.n=2",
                       "actor.micro_batch_size_per_gpu=2", *overrides)  # fmt: skip
    train(tiny, log=lambda *args, **kwargs: None)
    metrics = read_metrics(tiny.trainer.run_dir)
    assert set(metrics) == {1} and metrics[1]["actor/grad_norm"] > 0
