"""verl's batch-size semantics give the per-GPU sizes verl documents for its examples."""

import pytest
from verl_command_lines import command_line

from hybridflow.config import validate
from hybridflow.config.verl import load_with_verl_keys, translate


def _load(items):
    return load_with_verl_keys(None, items, log=lambda text: None)


def test_grpo_example_per_gpu_sizes():
    # run_qwen2-7b.sh: 1024 prompts × n=5 on 8 GPUs; mini-batch 256 prompts; micro 40 samples.
    cfg = _load(command_line("grpo_qwen2_7b"))
    derived = validate(cfg)
    assert derived.samples_per_step == 1024 * 5
    assert derived.mini_batch_samples_per_gpu == 256 * 5 // 8 == 160
    assert derived.micro_batches_per_mini_batch == 160 // 40 == 4
    assert derived.mini_batches_per_step == 1024 // 256
    assert cfg.ref.micro_batch_size_per_gpu == 40
    assert cfg.trainer.backend == "local"


def test_ppo_example_takes_verls_default_n_of_one():
    # run_deepseek7b_llm.sh sets no rollout.n: verl samples once per prompt.
    cfg = _load(command_line("ppo_deepseek7b_llm"))
    derived = validate(cfg)
    assert cfg.rollout.n == 1 and cfg.algorithm.adv_estimator == "gae"
    assert derived.mini_batch_samples_per_gpu == 256 // 8 == 32
    assert derived.micro_batches_per_mini_batch == 32 // 16  # ppo_micro_batch_size_per_gpu=16
    assert cfg.critic.micro_batch_size_per_gpu == 32


def test_dynamic_batch_sizes_become_token_budgets_and_are_inherited():
    cfg = _load(command_line("ppo_qwen2_7b_seq_balance"))
    assert cfg.actor.max_tokens_per_gpu == 24000
    assert cfg.ref.max_tokens_per_gpu == 24000  # inherited from the actor, as in verl
    assert cfg.critic.max_tokens_per_gpu == 98304
    assert validate(cfg).micro_batches_per_mini_batch is None
    # rollout.log_prob_max_token_len_per_gpu: the old-log-prob pass's own budget
    assert cfg.actor.log_prob_max_tokens_per_gpu == 24000


def test_old_log_prob_budget_is_taken_with_or_without_dynamic_batch_sizes():
    # verl reads log_prob_max_token_len_per_gpu only with log_prob_use_dynamic_bsz=True; the
    # pass here always packs by tokens, so the budget is kept and the flag is a notice.
    rollout = "actor_rollout_ref.rollout."
    t = translate([rollout + "log_prob_use_dynamic_bsz=False",
                   rollout + "log_prob_max_token_len_per_gpu=12288",
                   rollout + "log_prob_micro_batch_size_per_gpu=2"])  # fmt: skip
    assert "actor.log_prob_max_tokens_per_gpu=12288" in t.overrides
    noticed = {n.verl: n.why for n in t.notices}
    assert "actor.log_prob_max_tokens_per_gpu" in noticed[rollout + "log_prob_use_dynamic_bsz"]
    assert rollout + "log_prob_micro_batch_size_per_gpu" in noticed
    assert not any("micro_batch_size_per_gpu=2" in o for o in t.overrides)
    # the reference's budget goes to ref.max_tokens_per_gpu, its only pass
    ref = _load(["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
                 "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=20480"])  # fmt: skip
    assert ref.ref.max_tokens_per_gpu == 20480


def test_dynamic_off_keeps_micro_batches_and_ignores_the_budget():
    t = translate(
        [
            "actor_rollout_ref.actor.use_dynamic_bsz=False",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=9000",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        ]
    )
    assert "actor.max_tokens_per_gpu=null" in t.overrides
    assert "actor.micro_batch_size_per_gpu=4" in t.overrides
    assert any(n.verl.endswith("ppo_max_token_len_per_gpu") for n in t.notices)


@pytest.mark.parametrize(
    "role, key, ours",
    [
        ("actor", "actor_rollout_ref.actor.ppo_micro_batch_size", "actor"),
        ("ref", "actor_rollout_ref.ref.log_prob_micro_batch_size", "ref"),
        ("critic", "critic.ppo_micro_batch_size", "critic"),
    ],
)
def test_global_micro_batch_is_divided_by_the_devices(role, key, ours):
    devices = ["trainer.nnodes=2", "trainer.n_gpus_per_node=4"]
    t = translate([f"{key}=64", *devices])
    assert f"{ours}.micro_batch_size_per_gpu=8" in t.overrides  # 64 samples over 8 GPUs
    assert "trainer.backend=ray" in t.overrides  # two nodes
    bad = translate([f"{key}=12", *devices])
    assert bad.problems and key in bad.problems[0] and "multiple of 8" in bad.problems[0]


def test_warmup_counts_rl_steps_as_verl_does():
    # verl steps the schedule once per RL step; here once per optimizer step: 1024/256 = 4
    # mini-batches × 2 epochs = 8 optimizer steps per RL step.
    t = translate(
        [
            "data.train_batch_size=1024",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256",
            "actor_rollout_ref.actor.ppo_epochs=2",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
        ]
    )
    assert "actor.lr_warmup_steps=80" in t.overrides
    ratio = translate(
        [
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
            "trainer.total_training_steps=50",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256",
        ]
    )
    assert "actor.lr_warmup_steps=20" in ratio.overrides  # 0.1 × 50 RL steps × 4
    assert "trainer.total_steps=50" in ratio.overrides
    assert translate(["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"]).problems
