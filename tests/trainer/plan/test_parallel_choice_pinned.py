"""What `config plan` recommends (trainer/plan/parallel_choice.py), pinned line for line for
models and clusters from one GPU to 128: the keys it prints and the peak, or the closest
layout where nothing fits. The search may get faster; what it recommends may not change
(the preference order is docs/parallelism.md's, The plan at scale). That section's table is
pinned row by row too: with the recommended keys set, the KV cache a rollout replica holds
and the peaks it quotes."""

from __future__ import annotations

import pytest

from hybridflow.config import Config, load_config, validate
from hybridflow.trainer.plan.memory_fixes import overrides_text
from hybridflow.trainer.plan.memory_from_config import plan_for_config
from hybridflow.trainer.plan.memory_plan import GENERATE, GIB, UPDATE
from hybridflow.trainer.plan.parallel_choice import recommend
from hybridflow.trainer.plan.parallel_section import recommendation_text

GRPO = ["data.max_prompt_length=1024", "data.max_response_length=4096", "rollout.n=8",
        "actor.max_tokens_per_gpu=16384", "rollout.max_num_seqs=256",
        "rollout.gpu_memory_utilization=0.9", "actor.use_kl_loss=true", "trainer.device=cuda",
        "trainer.backend=ray"]  # fmt: skip


def grpo_config(model: str, nodes: int, gpus: int, batch: int,
                extra: tuple[str, ...] = ()) -> Config:  # fmt: skip
    """A GRPO run of docs/parallelism.md, The plan at scale (mini-batches of a quarter)."""
    return load_config(None, [f"model.path={model}", f"trainer.nnodes={nodes}",
                              f"trainer.n_gpus_per_node={gpus}", f"data.train_batch_size={batch}",
                              f"actor.ppo_mini_batch_size={batch // 4}", *GRPO, *extra])  # fmt: skip


def printed(model: str, nodes: int, gpus: int, batch: int, gpu_bytes: int,
            extra: tuple[str, ...] = ()) -> str:  # fmt: skip
    """The recommendation line `config plan` prints for a GRPO run (docs/parallelism.md)."""
    cfg = grpo_config(model, nodes, gpus, batch, extra)
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
     'rollout.expert_parallel_size=32 (peak 75.8 GiB in the generation, fits; 875.8 GiB of '
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


# docs/parallelism.md's table of the plan at scale, row by row: the keys `config plan`
# recommends, and with them set (the plan run again, as the table's last column is made) the
# sequences of prompt + response (5,120 tokens) a rollout replica's KV cache holds at once and
# the generation and update peaks in GiB. A change to the memory plan that moves a number
# fails here: refresh the table with it.
TP8_HOST = (
    "rollout.tensor_parallel_size=8 model.gradient_checkpointing=true actor.param_offload=true"
)
TABLE = [
    ("llama3.1-70b", 1, 8, 128, 80 * GIB, "actor.tensor_parallel_size=2 " + TP8_HOST,
     156, (76.3, 67.5)),
    ("llama3.1-70b", 1, 8, 128, 140 * GIB, TP8_HOST, 256, (95.8, 80.3)),
    ("llama3.1-70b", 2, 8, 128, 80 * GIB, TP8_HOST, 194, (75.5, 72.1)),
    ("llama3.1-70b", 2, 8, 128, 140 * GIB, TP8_HOST, 256, (87.5, 72.1)),
    ("moonlight-16b-a3b", 1, 8, 128, 80 * GIB,
     "actor.expert_parallel_size=8 rollout.tensor_parallel_size=4 "
     "model.gradient_checkpointing=true", 256, (74.0, 60.8)),
    ("qwen3.5-35b-a3b", 1, 8, 128, 80 * GIB,
     "actor.expert_parallel_size=8 rollout.tensor_parallel_size=2 "
     "model.gradient_checkpointing=true actor.param_offload=true", 256, (63.6, 59.5)),
    ("gpt-oss-120b", 1, 8, 128, 80 * GIB,
     "actor.expert_parallel_size=8 " + TP8_HOST, 256, (63.3, 74.7)),
    ("qwen3-235b-a22b", 4, 8, 128, 80 * GIB,
     "actor.expert_parallel_size=32 rollout.tensor_parallel_size=2 "
     "model.gradient_checkpointing=true actor.param_offload=true "
     "rollout.expert_parallel_size=32", 71, (75.8, 67.2)),
    ("qwen3-235b-a22b", 8, 8, 128, 140 * GIB,
     "actor.expert_parallel_size=64 model.gradient_checkpointing=true "
     "actor.param_offload=true rollout.expert_parallel_size=8", 51, (134.1, 107.5)),
    ("deepseek-v3", 12, 8, 96, GB96,
     "actor.expert_parallel_size=32 rollout.tensor_parallel_size=2 "
     "model.gradient_checkpointing=true rollout.release_weights=true "
     "actor.param_offload=true rollout.expert_parallel_size=32", 26, (87.3, 60.0)),
    ("deepseek-v3", 16, 8, 128, GB96,
     "actor.expert_parallel_size=128 rollout.tensor_parallel_size=2 "
     "model.gradient_checkpointing=true actor.param_offload=true "
     "rollout.expert_parallel_size=128", 111, (84.1, 83.2)),
]  # fmt: skip


def table_row_id(row) -> str:
    model, nodes, gpus, _, gpu_bytes = row[:5]
    size = f"{gpu_bytes // GIB}GiB" if gpu_bytes % GIB == 0 else f"{gpu_bytes // 10**9}GB"
    return f"{model}-{nodes * gpus}x{size}"


@pytest.mark.parametrize("model, nodes, gpus, batch, gpu_bytes, keys, sequences, peaks", TABLE,
                         ids=[table_row_id(row) for row in TABLE])  # fmt: skip
def test_the_recommended_keys_give_the_kv_cache_the_table_quotes(model, nodes, gpus, batch,
                                                                 gpu_bytes, keys, sequences,
                                                                 peaks):  # fmt: skip
    advice = recommend(grpo_config(model, nodes, gpus, batch), gpu_bytes)
    assert overrides_text(advice.changes) == keys
    cfg = grpo_config(model, nodes, gpus, batch, tuple(keys.split()))
    plan = plan_for_config(cfg, validate(cfg), gpu_bytes)
    assert plan.options.rollout_max_seq_len == 5_120
    assert plan.kv_slots == sequences
    assert tuple(round(plan.phase_bytes(phase) / GIB, 1) for phase in (GENERATE, UPDATE)) == peaks
