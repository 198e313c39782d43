"""`config from-verl`: the YAML it writes loads to the config the command line resolves to."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from verl_command_lines import RUNS, command_line

from hybridflow.cli import main
from hybridflow.config import load_config
from hybridflow.config.verl import load_with_verl_keys, to_yaml, translate
from hybridflow.config.verl.group_table import GROUPS
from hybridflow.config.verl.rules import Rename
from hybridflow.config.verl.table import SHARED_TABLE, TABLE

A, R, REF = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."
# Three command lines that together set every verl key the table renames or a group reads
# (keys that exclude each other, like a per-GPU and a global micro-batch size, in different
# lines), each to a value other than the default.
MAPPED = [
    [
        "actor_rollout_ref.model.path=tiny",
        "actor_rollout_ref.model.tokenizer_path=/tok",
        "actor_rollout_ref.model.freeze_vision_tower=False",
        "data.image_key=pictures",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=all-linear",
        A + "optim.lr=3e-6",
        A + "optim.weight_decay=0.1",
        A + "optim.betas=[0.9,0.95]",
        A + "optim.clip_grad=0.5",
        A + "optim.min_lr_ratio=0.1",
        A + "optim.lr_scheduler_type=cosine",
        A + "optim.lr_warmup_steps=3",
        A + "checkpoint.async_save=True",
        A + "use_torch_compile=False",
        A + "ppo_mini_batch_size=16",
        A + "ppo_epochs=2",
        A + "shuffle=True",
        A + "clip_ratio=0.25",
        A + "clip_ratio_high=0.28",
        A + "clip_ratio_c=4.0",
        A + "loss_agg_mode=seq-mean-token-mean",
        A + "entropy_coeff=0.01",
        A + "use_kl_loss=True",
        A + "kl_loss_coef=0.02",
        A + "kl_loss_type=k3",
        A + "grad_clip=0.7",
        A + "fsdp_config.param_offload=True",
        A + "fsdp_config.optimizer_offload=True",
        A + "ppo_micro_batch_size_per_gpu=4",
        A + "policy_loss.loss_mode=clip_cov",
        A + "policy_loss.clip_cov_ratio=0.001",
        A + "policy_loss.clip_cov_lb=0.5",
        A + "policy_loss.clip_cov_ub=4.0",
        REF + "fsdp_config.param_offload=True",
        REF + "log_prob_micro_batch_size_per_gpu=8",
        R + "n=4",
        R + "temperature=0.7",
        R + "do_sample=True",
        R + "top_k=20",
        R + "top_p=0.9",
        R + "ignore_eos=True",
        R + "max_num_seqs=64",
        R + "gpu_memory_utilization=0.6",
        R + "free_cache_engine=False",
        R + "enforce_eager=True",
        R + "tensor_model_parallel_size=2",
        R + "val_kwargs.do_sample=True",
        R + "val_kwargs.temperature=0.6",
        R + "val_kwargs.n=3",
        R + "val_kwargs.top_p=0.9",
        R + "val_kwargs.top_k=5",
        "critic.optim.lr=2e-5",
        "critic.optim.clip_grad=0.3",
        "critic.optim.lr_warmup_steps=2",
        "critic.model.path=/critic",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "critic.forward_micro_batch_size_per_gpu=8",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.kl_ctrl.horizon=500",
        "algorithm.kl_ctrl.target_kl=0.2",
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.max_num_gen_batches=5",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=3.0",
        "algorithm.rollout_correction.rollout_rs=null",
        "algorithm.rollout_correction.bypass_mode=False",
        "algorithm.rollout_correction.rollout_is_batch_normalize=False",
        "algorithm.rollout_correction.loss_type=ppo_clip",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        "reward_model.reward_manager=dapo",
        "reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=8",
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
        "reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
        "custom_reward_function.path=/r.py",
        "custom_reward_function.name=score",
        "trainer.logger=['console','tensorboard']",
        "trainer.rollout_data_dir=/rollouts",
        "trainer.default_local_dir=/ckpt",
        "trainer.max_actor_ckpt_to_keep=3",
        "trainer.save_freq=0",
        "trainer.device=cuda",
        "data.val_batch_size=32",
        "trainer.resume_mode=disable",
        "trainer.total_epochs=2",
    ],
    [
        "actor_rollout_ref.model.lora.rank=4",
        "actor_rollout_ref.model.lora.alpha=8",
        "data.tokenizer=/tok2",
        A + "optim.warmup_style=linear",
        A + "optim.lr_warmup_steps_ratio=0.2",
        A + "clip_ratio_low=0.1",
        A + "use_dynamic_bsz=True",
        A + "ppo_max_token_len_per_gpu=4096",
        A + "policy_loss.loss_mode=kl_cov",
        A + "policy_loss.kl_cov_ratio=0.003",
        A + "policy_loss.ppo_kl_coef=0.2",
        REF + "log_prob_use_dynamic_bsz=True",
        REF + "log_prob_max_token_len_per_gpu=2048",
        R + "log_prob_max_token_len_per_gpu=6144",
        "critic.use_dynamic_bsz=True",
        "critic.ppo_max_token_len_per_gpu=8192",
        "critic.forward_max_token_len_per_gpu=8192",
        "critic.optim.lr_warmup_steps_ratio=0.1",
        "reward_manager.name=batch",
        "trainer.total_training_steps=20",
        "trainer.resume_mode=resume_path",
        "trainer.resume_from_path=/ckpt/step_5",
        "data.filter_overlong_prompts=False",
        "data.truncation=left",
        "trainer.n_gpus_per_node=4",
    ],
    [
        A + "optim.lr_decay_style=constant",
        A + "ppo_micro_batch_size=8",
        A + "policy_loss.loss_mode=sapo",
        A + "tau_pos=1.1",
        A + "tau_neg=1.2",
        REF + "log_prob_micro_batch_size=16",
        "critic.ppo_micro_batch_size=8",
        "critic.forward_micro_batch_size=8",
        R + "do_sample=False",
        R + "val_kwargs.do_sample=False",
        "trainer.n_gpus_per_node=2",
        A + "router_replay.mode=R3",
        R + "enable_rollout_routing_replay=True",
        A + "freeze_vision_tower=True",
    ],
    [
        A + "ulysses_sequence_parallel_size=2",
        A + "megatron.tensor_model_parallel_size=2",
        A + "megatron.expert_model_parallel_size=2",
        REF + "ulysses_sequence_parallel_size=1",
        REF + "megatron.tensor_model_parallel_size=1",
        REF + "megatron.expert_model_parallel_size=1",
        "critic.ulysses_sequence_parallel_size=1",
        "critic.megatron.tensor_model_parallel_size=1",
        "critic.megatron.expert_model_parallel_size=1",
        R + "expert_parallel_size=2",
    ],
    [
        A + "megatron.override_transformer_config.fp8=e4m3",
        A + "megatron.override_transformer_config.fp8_recipe=tensorwise",
        "algorithm.adv_estimator=gae",
        "critic.megatron.override_transformer_config.fp8=hybrid",
        "critic.megatron.override_transformer_config.fp8_recipe=blockwise",
        "trainer.device=cuda",
    ],
    [
        A + "megatron.param_offload=True",
        REF + "megatron.param_offload=True",
        A + "megatron.override_transformer_config.recompute_granularity=full",
        "trainer.n_gpus_per_node=2",
    ],
    [
        "reward_model.enable=True",
        "reward_model.model.path=/models/rm",
        "reward_model.micro_batch_size_per_gpu=4",
        "reward_model.use_dynamic_bsz=True",
        "reward_model.forward_max_token_len_per_gpu=4096",
        "reward_model.model.fsdp_config.param_offload=True",
        "reward_model.strategy=fsdp2",
        "reward_model.model.input_tokenizer=/models/policy",
    ],
    [
        "reward_model.enable=True",
        "reward_model.model.path=/models/rm",
        "reward_model.micro_batch_size=8",
        "trainer.n_gpus_per_node=2",
    ],
    [
        "reward_model.enable=True",
        "reward_model.model.path=/models/rm",
        "reward_model.enable_resource_pool=True",
        "reward_model.n_gpus_per_node=1",
        "reward_model.nnodes=1",
        "trainer.n_gpus_per_node=1",
    ],
]


def _keys(lines):
    return {item.split("=")[0] for line in lines for item in line}


def test_every_mapped_key_is_in_the_round_trip_command_lines():
    renamed = {e.verl for e in [*TABLE, *SHARED_TABLE] if isinstance(e, Rename)}
    grouped = {key for group in GROUPS for key in group.keys}
    assert (renamed | grouped) - _keys(MAPPED) == set()


@pytest.mark.parametrize("items", [*MAPPED, *(command_line(name) for name in RUNS)])
def test_from_verl_yaml_loads_to_the_same_config(items, tmp_path):
    translation = translate(items)
    assert translation.problems == []
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(translation))
    direct = load_with_verl_keys(None, items, log=lambda text: None)
    assert dataclasses.asdict(load_config(path)) == dataclasses.asdict(direct)
    assert direct != load_config(None)


def test_each_yaml_line_names_the_verl_key_it_came_from():
    translation = translate(MAPPED[0])
    text = to_yaml(translation)
    assert "lr: 3e-6  # verl: actor_rollout_ref.actor.optim.lr=3e-6" in text
    assert "cuda_graphs: false  # verl: actor_rollout_ref.rollout.enforce_eager=True" in text
    assert "# verl keys accepted without effect:" in text
    assert yaml.safe_load(text)["rollout"]["engine"] == {"cuda_graphs": False}


def test_from_verl_command(capsys):
    assert main(["config", "from-verl", "actor_rollout_ref.rollout.n=3"]) == 0
    assert "n: 3  # verl: actor_rollout_ref.rollout.n=3" in capsys.readouterr().out
    pipeline = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"
    assert main(["config", "from-verl", pipeline]) == 2
    err = capsys.readouterr().err
    assert "Megatron-LM pipeline parallelism" in err and "Traceback" not in err


def test_docs_example_is_what_from_verl_writes():
    doc = (Path(__file__).resolve().parents[3] / "docs" / "migrating-from-verl.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", doc, re.S).group(1)
    assert block == to_yaml(translate(command_line("grpo_qwen2_7b")))
