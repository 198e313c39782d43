"""The verl mapping table: every verl config key hybridflow knows, and what becomes of it.

Keys are verl's (``verl/trainer/config/ppo_trainer.yaml``); the first entry that matches a
key wins, so exact keys come before the ``prefix.*`` that would also match them. Keys read
together (batch sizes, a reward file and its function, ...) are in ``groups.py``.
docs/migrating-from-verl.md shows this table; ``python -m hybridflow.config.verl.doc``
regenerates it there.
"""

from __future__ import annotations

from hybridflow.config.verl import converters as cv
from hybridflow.config.verl.role_tables import (
    ACTOR_TABLE,
    CRITIC_TABLE,
    MODEL_TABLE,
    OPTIM_TABLE,
    REF_TABLE,
    ROLLOUT_TABLE,
)
from hybridflow.config.verl.rules import Entry, Ignored, Rename, Unsupported
from hybridflow.config.verl.table_parts import (
    ACTOR,
    ARR,
    PROFILER,
    REWARD_MODEL,
    ROLLOUT,
    is_off,
)

# Top-level sections that only verl has: a key under them is verl's by its name alone.
VERL_ONLY_SECTIONS = (
    "actor_rollout_ref",
    "reward_model",
    "custom_reward_function",
    "reward_manager",
    "global_profiler",
    "ray_kwargs",
    "transfer_queue",
)


ALGORITHM_TABLE: list[Entry] = [
    Rename("algorithm.kl_ctrl.type", "algorithm.kl_ctrl_type"),
    Rename("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef"),
    Rename("algorithm.kl_ctrl.horizon", "algorithm.kl_horizon"),
    Rename("algorithm.kl_ctrl.target_kl", "algorithm.kl_target"),
    Rename("algorithm.filter_groups.enable", "algorithm.dynamic_sampling"),
    Rename(
        "algorithm.filter_groups.max_num_gen_batches", "algorithm.max_gen_rounds", cv.gen_rounds
    ),
    Ignored(
        "algorithm.filter_groups.metric", "groups whose samples all score the same are dropped"
    ),
    Unsupported("algorithm.use_pf_ppo", "PF-PPO (reward-weighted resampling)", is_off, "False"),
    Ignored("algorithm.pf_ppo.*", "applies only with algorithm.use_pf_ppo=True"),
]

DATA_TABLE: list[Entry] = [
    Rename("data.tokenizer", "model.tokenizer_path"),
    Ignored("data.filter_overlong_prompts_workers", "prompts are tokenized once, up front"),
    Ignored("data.dataloader_num_workers", "prompts are tokenized once, up front"),
    Ignored("data.return_raw_chat", "prompts keep their chat messages"),
    Ignored("data.return_raw_input_ids", "prompts keep their chat messages"),
    Ignored("data.return_full_prompt", "prompts keep their chat messages"),
    Ignored("data.validation_shuffle", "validation prompts are read in order"),
    Ignored("data.use_shm", "data files are read from their path"),
    Ignored("data.trust_remote_code", "no tokenizer code is downloaded or run"),
    Ignored("data.seed", "data order follows trainer.seed"),
    Unsupported(
        "data.reward_fn_key",
        "choosing the scorer by a column other than data_source",
        lambda v: v == "data_source",
        "data_source",
    ),
    Unsupported(
        "data.train_max_samples", "capping the prompts read", lambda v: v in (None, -1), "-1"
    ),
    Unsupported(
        "data.val_max_samples", "capping the prompts read", lambda v: v in (None, -1), "-1"
    ),
    Rename("data.image_key", "data.image_key"),
    Unsupported("data.video_key", "videos (frames through a vision encoder)"),
    Ignored("data.return_multi_modal_inputs", "a prompt's images travel in the Batch with it"),
    Ignored("data.image_patch_size", "the patch size is the model's image processor's"),
    Unsupported("data.custom_cls.path", "custom dataset classes", is_off, "null"),
    Ignored("data.custom_cls.name", "applies only with data.custom_cls.path"),
    Unsupported("data.sampler.class_path", "custom samplers (curricula)", is_off, "null"),
    Ignored("data.sampler.class_name", "applies only with data.sampler.class_path"),
    Unsupported("data.datagen.path", "generated datasets", is_off, "null"),
    Ignored("data.datagen.name", "applies only with data.datagen.path"),
    Unsupported(
        "data.tool_config_path",
        "verl's tool config (hybridflow: rollout.agent.tools)",
        is_off,
        "null",
    ),
    Unsupported("data.apply_chat_template_kwargs.*", "chat template keyword arguments"),
]

REWARD_TABLE: list[Entry] = [
    Rename("reward_model.reward_manager", "reward.manager"),
    Rename("reward_manager.name", "reward.manager"),
    Ignored("reward_manager.source", "reward managers are named by reward.manager"),
    Unsupported("reward_manager.module.path", "custom reward manager classes", is_off, "null"),
    Ignored("reward_manager.module.*", "applies only with reward_manager.module.path"),
    Ignored("reward_model.reward_kwargs.max_resp_len", "follows data.max_response_length"),
    Unsupported("reward_model.reward_kwargs.*", "reward manager keyword arguments"),
    Ignored("reward_model.launch_reward_fn_async", "scoring runs in reward.num_workers processes"),
    Unsupported(
        "reward_model.sandbox_fusion.url",
        "SandboxFusion (code rewards run in hybridflow's local sandbox)",
        is_off,
        "null",
    ),
    Ignored("reward_model.sandbox_fusion.*", "applies only with sandbox_fusion.url"),
    Ignored("reward_model.*", REWARD_MODEL),
    Unsupported(
        "custom_reward_function.reward_kwargs.*", "keyword arguments of the reward function"
    ),
]

TRAINER_TABLE: list[Entry] = [
    Rename(
        "trainer.logger",
        "trainer.loggers",
        cv.loggers,
        how="verl's file logger is jsonl: <run_dir>/metrics.jsonl",
    ),
    Rename(
        "trainer.default_local_dir",
        "trainer.run_dir",
        how="checkpoints go to <run_dir>/checkpoints",
    ),
    Rename("trainer.max_actor_ckpt_to_keep", "trainer.keep_last_k", cv.keep_checkpoints),
    Ignored("trainer.max_critic_ckpt_to_keep", "one checkpoint holds actor and critic"),
    Unsupported(
        "trainer.critic_warmup", "critic warm-up (actor updates held for N steps)", is_off, "0"
    ),
    Ignored("trainer.balance_batch", "micro-batches are always balanced by tokens across ranks"),
    Ignored("trainer.log_val_generations", "validation generations are not logged"),
    Rename("trainer.rollout_data_dir", "trainer.rollout_data_dir"),
    Unsupported("trainer.validation_data_dir", "dumping validation generations", is_off, "null"),
    Unsupported("trainer.default_hdfs_dir", "copying checkpoints to HDFS", is_off, "null"),
    Ignored("trainer.del_local_ckpt_after_load", "checkpoints are kept per trainer.keep_last_k"),
    Unsupported("trainer.val_only", "validation-only runs", is_off, "False"),
    Ignored("trainer.use_legacy_worker_impl", "there is one worker implementation"),
    Ignored("trainer.esi_redundant_time", "no elastic-instance deadlines"),
    Ignored(
        "trainer.ray_wait_register_center_timeout",
        "remote calls time out after trainer.call_timeout_s",
    ),
]

MISC_TABLE: list[Entry] = [
    Ignored(
        ARR + "hybrid_engine", "actor, rollout and ref share devices (trainer.placement=colocate)"
    ),
    Ignored(ARR + "nccl_timeout", "remote calls time out after trainer.call_timeout_s"),
    Ignored("global_profiler.*", PROFILER),
    Ignored("ray_kwargs.*", "the ray backend joins the running cluster (address=auto)"),
    Unsupported("transfer_queue.enable", "TransferQueue", is_off, "False"),
    Ignored("transfer_queue.*", "applies only with transfer_queue.enable=True"),
]

# Keys both configs have whose values differ in meaning: translated on a verl command line
# (one with at least one verl-only key), taken as ours otherwise.
SHARED_TABLE: list[Entry] = [
    Rename(
        "trainer.save_freq",
        "trainer.save_freq",
        cv.save_freq,
        "verl saves only when > 0: 0 or -1 -> -1 (never)",
    ),
    Rename("trainer.device", "trainer.device", cv.device),
    Rename("data.val_batch_size", "data.val_batch_size", cv.val_batch_size),
]

TABLE: list[Entry] = [
    *MODEL_TABLE,
    *OPTIM_TABLE,
    *ACTOR_TABLE,
    *REF_TABLE,
    *ROLLOUT_TABLE,
    *CRITIC_TABLE,
    *ALGORITHM_TABLE,
    *DATA_TABLE,
    *REWARD_TABLE,
    *TRAINER_TABLE,
    *MISC_TABLE,
]


# verl's defaults where ours differ and the meaning of a run changes: on a verl command line,
# a key it leaves out means verl's default (unless our key is given or set in the YAML file).
VERL_DEFAULTS: tuple[tuple[str, str, object], ...] = (
    ("algorithm.adv_estimator", "algorithm.adv_estimator", "gae"),
    ("data.train_batch_size", "data.train_batch_size", 1024),
    ("data.max_prompt_length", "data.max_prompt_length", 512),
    ("data.max_response_length", "data.max_response_length", 512),
    ("data.filter_overlong_prompts", "data.overlong_prompts", "error"),
    (ROLLOUT + "n", "rollout.n", 1),
    (ROLLOUT + "val_kwargs.do_sample", "rollout.val_temperature", 0.0),
    (ROLLOUT + "val_kwargs.n", "rollout.val_n", 1),
    (ACTOR + "optim.lr", "actor.lr", 1e-6),
    (ACTOR + "optim.weight_decay", "actor.weight_decay", 0.01),
    (ACTOR + "ppo_mini_batch_size", "actor.ppo_mini_batch_size", 256),
    ("trainer.total_epochs", "trainer.total_epochs", 30),
    ("trainer.test_freq", "trainer.test_freq", 0),
    ("trainer.save_freq", "trainer.save_freq", -1),
)
