"""The verl keys read together (groups.py, devices.py): which keys each rule reads and, for
the docs, what each becomes."""

from __future__ import annotations

from hybridflow.config.verl import devices, groups
from hybridflow.config.verl.rules import Group
from hybridflow.config.verl.table_parts import ACTOR, REF, ROLLOUT

GROUPS: tuple[Group, ...] = (
    Group(
        "actor batch sizes",
        {
            ACTOR + "ppo_micro_batch_size_per_gpu": "actor.micro_batch_size_per_gpu",
            ACTOR
            + "ppo_micro_batch_size": "actor.micro_batch_size_per_gpu = value ÷ (devices / (Ulysses × tensor parallel))",
            ACTOR + "use_dynamic_bsz": "True: actor.max_tokens_per_gpu = ppo_max_token_len_per_gpu",
            ACTOR + "ppo_max_token_len_per_gpu": "actor.max_tokens_per_gpu (with use_dynamic_bsz)",
        },
        groups.actor_batch,
    ),
    Group(
        "reference batch sizes",
        {
            REF + "log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size_per_gpu",
            REF
            + "log_prob_micro_batch_size": "ref.micro_batch_size_per_gpu = value ÷ (devices / (Ulysses × tensor parallel))",
            REF + "log_prob_use_dynamic_bsz": "True: ref.max_tokens_per_gpu (default: the actor's)",
            REF + "log_prob_max_token_len_per_gpu": "ref.max_tokens_per_gpu (default: the actor's)",
        },
        groups.ref_batch,
        also_when=(ACTOR + "use_dynamic_bsz", ACTOR + "ppo_max_token_len_per_gpu"),
    ),
    Group(
        "critic batch sizes",
        {
            "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size_per_gpu",
            "critic.ppo_micro_batch_size": "critic.micro_batch_size_per_gpu = value ÷ (devices / (Ulysses × tensor parallel))",
            "critic.use_dynamic_bsz": "True: critic.max_tokens_per_gpu (default: the actor's flag)",
            "critic.ppo_max_token_len_per_gpu": "critic.max_tokens_per_gpu (verl default 32768)",
            "critic.forward_micro_batch_size": "unused: the forward uses the training sizes",
            "critic.forward_micro_batch_size_per_gpu": "unused: the forward uses the training sizes",
            "critic.forward_max_token_len_per_gpu": "unused: the forward uses the training sizes",
        },
        groups.critic_batch,
        also_when=(ACTOR + "use_dynamic_bsz",),
    ),
    Group(
        "actor warm-up",
        {
            ACTOR
            + "optim.lr_warmup_steps": "actor.lr_warmup_steps = value × optimizer steps per RL step",
            ACTOR
            + "optim.lr_warmup_steps_ratio": "actor.lr_warmup_steps = ratio × trainer.total_training_steps × optimizer steps per RL step",
        },
        groups.actor_warmup,
    ),
    Group(
        "critic warm-up",
        {
            "critic.optim.lr_warmup_steps": "critic.lr_warmup_steps = value × optimizer steps per RL step",
            "critic.optim.lr_warmup_steps_ratio": "critic.lr_warmup_steps = ratio × trainer.total_training_steps × optimizer steps per RL step",
        },
        groups.critic_warmup_steps,
    ),
    Group(
        "clip ratios",
        {
            ACTOR + "clip_ratio": "actor.clip_ratio_low and actor.clip_ratio_high",
            ACTOR + "clip_ratio_low": "actor.clip_ratio_low",
            ACTOR + "clip_ratio_high": "actor.clip_ratio_high",
        },
        groups.clip_ratios,
    ),
    Group(
        "policy loss",
        {
            ACTOR + "policy_loss.loss_mode": "actor.policy_loss (+ verl's defaults of its options)",
            **{
                groups.option_key(name): f"actor.policy_loss_kwargs.{name} (loss_mode={owner})"
                for name, (owner, _) in groups.LOSS_OPTIONS.items()
            },
        },
        groups.policy_loss,
    ),
    Group(
        "overlong prompts",
        {
            "data.filter_overlong_prompts": "True: data.overlong_prompts = filter",
            "data.truncation": "error -> data.overlong_prompts = error; left -> truncate",
        },
        groups.overlong_prompts,
    ),
    Group(
        "reward function",
        {
            "custom_reward_function.path": "reward.custom_fn = path:name",
            "custom_reward_function.name": "reward.custom_fn = path:name (default compute_score)",
        },
        groups.reward_function,
    ),
    Group(
        "reward model",
        {
            "reward_model.enable": "True: a reward model (reward.model.*)",
            "reward_model.model.path": "reward.model.path",
            "reward_model.micro_batch_size_per_gpu": "reward.model.micro_batch_size_per_gpu",
            "reward_model.micro_batch_size": "reward.model.micro_batch_size_per_gpu = value ÷ devices",
            "reward_model.use_dynamic_bsz": "True: reward.model.max_tokens_per_gpu = forward_max_token_len_per_gpu",
            "reward_model.forward_max_token_len_per_gpu": "reward.model.max_tokens_per_gpu (with use_dynamic_bsz)",
            "reward_model.model.fsdp_config.param_offload": "reward.model.param_offload",
            "reward_model.strategy": "fsdp, fsdp2: accepted; megatron: not supported",
            "reward_model.model.input_tokenizer": "unused: re-rendered whenever the tokenizers differ",
            "reward_model.enable_resource_pool": "True: reward.model.n_gpus_per_node = n_gpus_per_node (devices of its own)",
            "reward_model.n_gpus_per_node": "reward.model.n_gpus_per_node (with enable_resource_pool)",
            "reward_model.nnodes": "1 (with enable_resource_pool; more nodes: not supported)",
        },
        groups.reward_model,
    ),
    Group(
        "resume",
        {
            "trainer.resume_mode": "trainer.resume (auto | disable | the resume_from_path)",
            "trainer.resume_from_path": "trainer.resume (with resume_mode=resume_path)",
        },
        groups.resume,
    ),
    Group(
        "run length",
        {
            "trainer.total_epochs": "trainer.total_epochs",
            "trainer.total_training_steps": "trainer.total_steps (and trainer.total_epochs = null)",
        },
        groups.run_length,
    ),
    Group(
        "sampling",
        {
            ROLLOUT + "temperature": "rollout.temperature",
            ROLLOUT + "do_sample": "False: rollout.temperature = 0 (greedy)",
        },
        groups.sampling,
    ),
    Group(
        "validation sampling",
        {
            ROLLOUT
            + "val_kwargs.do_sample": "False (verl's default): rollout.val_temperature = 0, rollout.val_n = 1",
            ROLLOUT + "val_kwargs.temperature": "rollout.val_temperature (with do_sample=True)",
            ROLLOUT + "val_kwargs.n": "rollout.val_n (with do_sample=True)",
            ROLLOUT + "val_kwargs.top_p": "unused: validation samples with rollout.top_p",
            ROLLOUT + "val_kwargs.top_k": "unused: validation samples with rollout.top_k",
        },
        groups.validation_sampling,
    ),
    Group(
        "rollout correction",
        {
            f"algorithm.rollout_correction.{k}": v
            for k, v in (
                ("rollout_is", "token: actor.rollout_is_cap = rollout_is_threshold"),
                ("rollout_is_threshold", "actor.rollout_is_cap (with rollout_is=token)"),
                ("rollout_rs", "not supported (rejection sampling)"),
                ("bypass_mode", "not supported"),
                ("rollout_is_batch_normalize", "not supported"),
                ("loss_type", "ppo_clip only"),
            )
        },
        groups.rollout_correction,
    ),
    Group(
        "DAPO overlong reward",
        {
            f"reward_model.reward_kwargs.overlong_buffer_cfg.{k}": v
            for k, v in (
                ("enable", "False: reward.overlong_buffer_len = 0"),
                ("len", "reward.overlong_buffer_len"),
                ("penalty_factor", "reward.overlong_penalty_factor"),
                ("log", "unused: always logged"),
            )
        },
        groups.overlong_reward,
    ),
    Group(
        "rollout tensor parallelism",
        {
            ROLLOUT + "tensor_model_parallel_size": "rollout.tensor_parallel_size (the ranks "
            "of one engine replica)",
        },
        devices.tensor_parallel,
    ),
    Group(
        "routing replay (MoE)",
        {
            ACTOR + "router_replay.mode": "R3: actor.router_replay = rollout (R2 is not here)",
            ROLLOUT + "enable_rollout_routing_replay": "True: actor.router_replay = rollout",
        },
        groups.routing_replay,
    ),
)
