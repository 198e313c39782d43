"""What `config plan` recommends (trainer/plan/parallel_choice.py), pinned line for line for
models and clusters from one GPU to 128: the keys it prints and the peak, or the closest
layout where nothing fits. The search may get faster; what it recommends may not change
(the preference order is docs/parallelism.md's, The plan at scale)."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.trainer.plan.memory_plan import GIB
from hybridflow.trainer.plan.parallel_choice import recommend
from hybridflow.trainer.plan.parallel_section import recommendation_text

GRPO = ["data.max_prompt_length=1024", "data.max_response_length=4096", "rollout.n=8",
        "actor.max_tokens_per_gpu=16384", "rollout.max_num_seqs=256",
        "rollout.gpu_memory_utilization=0.9", "actor.use_kl_loss=true", "trainer.device=cuda",
        "trainer.backend=ray"]  # fmt: skip


def printed(model: str, nodes: int, gpus: int, batch: int, gpu_bytes: int,
            extra: tuple[str, ...] = ()) -> str:  # fmt: skip
    """The recommendation line `config plan` prints for a GRPO run (docs/parallelism.md)."""
    cfg = load_config(None, [f"model.path={model}", f"trainer.nnodes={nodes}",
                             f"trainer.n_gpus_per_node={gpus}", f"data.train_batch_size={batch}",
                             f"actor.ppo_mini_batch_size={batch // 4}", *GRPO, *extra])  # fmt: skip
    return recommendation_text(recommend(cfg, gpu_bytes), gpu_bytes)


GB96 = 96 * 10**9
CASES = [
    ("qwen2.5-7b", 1, 1, 16, 80 * GIB, (),
     'recommended layout: model.gradient_checkpointing=true actor.optimizer_offload=true '
     '(peak 75.6 GiB in the generation, fits; 89.2 GiB of host memory a node for what it '
     'offloads)'),
    ("llama3.1-70b", 1, 8, 128, 80 * GIB, (),
     'recommended layout: actor.tensor_parallel_size=2 rollout.tensor_parallel_size=8 '
     'model.gradient_checkpointing=true actor.param_offload=true (peak 76.3 GiB in the '
     'generation, fits; 1051.3 GiB of host memory a node for what it offloads)'),
    ("qwen3-30b-a3b", 1, 8, 128, 80 * GIB, (),
     'recommended layout: actor.expert_parallel_size=8 rollout.tensor_parallel_size=4 '
     'model.gradient_checkpointing=true actor.param_offload=true (peak 54.1 GiB in the '
     'generation, fits; 455.0 GiB of host memory a node for what it offloads)'),
    ("qwen3.5-35b-a3b", 1, 8, 128, 80 * GIB, (),
     'recommended layout: actor.expert_parallel_size=8 rollout.tensor_parallel_size=2 '
     'model.gradient_checkpointing=true actor.param_offload=true (peak 63.6 GiB in the '
     'generation, fits; 516.5 GiB of host memory a node for what it offloads)'),
    ("moonlight-16b-a3b", 1, 8, 128, 80 * GIB, (),
     'recommended layout: actor.expert_parallel_size=8 rollout.tensor_parallel_size=4 '
     'model.gradient_checkpointing=true (peak 74.0 GiB in the generation, fits)'),
    ("gpt-oss-120b", 1, 8, 128, 80 * GIB, (),
     'recommended layout: actor.expert_parallel_size=8 rollout.tensor_parallel_size=8 '
     'model.gradient_checkpointing=true actor.param_offload=true (peak 74.7 GiB in the '
     'actor update, fits; 1740.9 GiB of host memory a node for what it offloads)'),
    ("qwen3-235b-a22b", 4, 8, 128, 80 * GIB, (),
     'recommended layout: actor.expert_parallel_size=32 rollout.tensor_parallel_size=2 '
     'model.gradient_checkpointing=true actor.param_offload=true '
     'rollout.expert_parallel_size=32 (peak 75.4 GiB in the generation, fits; 875.8 GiB of '
     'host memory a node for what it offloads)'),
    ("deepseek-v3", 12, 8, 96, GB96, (),
     'recommended layout: actor.expert_parallel_size=32 rollout.tensor_parallel_size=2 '
     'model.gradient_checkpointing=true rollout.release_weights=true '
     'actor.param_offload=true rollout.expert_parallel_size=32 (peak 87.3 GiB in the '
     'generation, fits; 833.3 GiB of host memory a node for what it offloads)'),
    ("deepseek-v3", 16, 8, 128, GB96, (),
     'recommended layout: actor.expert_parallel_size=128 rollout.tensor_parallel_size=2 '
     'model.gradient_checkpointing=true actor.param_offload=true '
     'rollout.expert_parallel_size=128 (peak 84.1 GiB in the generation, fits; 624.9 GiB of '
     'host memory a node for what it offloads)'),
    ("qwen2.5-7b", 1, 2, 16, 26 * GIB, (),
     'recommended layout: rollout.tensor_parallel_size=2 model.gradient_checkpointing=true '
     'rollout.release_weights=true actor.param_offload=true ref.param_offload=true (peak '
     '24.5 GiB in the generation, fits; 127.7 GiB of host memory a node for what it '
     'offloads)'),
    ("qwen2.5-7b", 1, 2, 16, 26 * GIB, ("trainer.mode=async",),
     'no layout fits on GPUs of 26.0 GiB: the closest (rollout.tensor_parallel_size=2 '
     'model.gradient_checkpointing=true actor.param_offload=true ref.param_offload=true) '
     'needs 25.2 GiB in the actor update against 23.7 GiB usable (rollout weights (bf16 '
     'copy) 7.1 GiB, activations (16,384 tokens, checkpointed, compiled) 5.8 GiB, log-prob '
     'head (logits chunk, lm_head gradient) 4.2 GiB): more GPUs, larger GPUs, or a shorter '
     'actor.max_tokens_per_gpu'),
    ("qwen3-30b-a3b", 1, 1, 16, 80 * GIB, (),
     'no layout fits on GPUs of 80.0 GiB: the closest (model.gradient_checkpointing=true '
     'actor.optimizer_offload=true) needs 180.1 GiB in the actor update against 75.0 GiB '
     'usable (actor weights (bf16, masters on the host) 56.9 GiB, actor gradients (bf16) '
     '56.9 GiB, reference weights (bf16) 56.9 GiB): more GPUs, larger GPUs, or a shorter '
     'actor.max_tokens_per_gpu'),
    ("qwen3-235b-a22b", 1, 4, 16, 80 * GIB, (),
     'no layout fits on GPUs of 80.0 GiB: the closest (actor.expert_parallel_size=4 '
     'rollout.tensor_parallel_size=4 model.gradient_checkpointing=true '
     'rollout.release_weights=true actor.param_offload=true ref.param_offload=true) needs '
     '116.1 GiB in the generation against 75.0 GiB usable (rollout weights (bf16 copy) 109.5'
     ' GiB, rollout workspace (decode logits, prefill) 4.9 GiB, rollout fused q/k/v, gate/up'
     ' copies 1.7 GiB): more GPUs, larger GPUs, or a shorter actor.max_tokens_per_gpu'),
]  # fmt: skip


@pytest.mark.parametrize("model, nodes, gpus, batch, gpu_bytes, extra, expected", CASES)
def test_the_recommendation_is_the_preferred_layout_that_fits(model, nodes, gpus, batch,
                                                              gpu_bytes, extra, expected):  # fmt: skip
    assert printed(model, nodes, gpus, batch, gpu_bytes, extra) == expected
