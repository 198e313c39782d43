"""The verl mapping table: every verl config key hybridflow knows, and what becomes of it.

Keys are verl's (``verl/trainer/config/ppo_trainer.yaml``); the first entry that matches a
key wins, so exact keys come before the ``prefix.*`` that would also match them. Keys read
together (batch sizes, a reward file and its function, ...) are in ``groups.py``.
docs/migrating-from-verl.md shows this table; ``python -m hybridflow.config.verl.doc``
regenerates it there.
"""

from __future__ import annotations

from hybridflow.config.verl import converters as cv
from hybridflow.config.verl.rules import Entry, Ignored, Rename, Unsupported

ARR = "actor_rollout_ref."
MODEL, ACTOR, REF, ROLLOUT = ARR + "model.", ARR + "actor.", ARR + "ref.", ARR + "rollout."

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


def _off(value) -> bool:
    return value in (None, False, "false", "False", 0, {}, [])


def _one(value) -> bool:
    return value in (None, 1)


PACKED = "sequences are always packed (no compute on padding)"
CHUNKED = "log-probs and entropy are always computed from hidden states in chunks"
PROFILER = "profiling is not part of the run config (benchmarks/ hold the profiling tools)"
ENGINE = "hybridflow generates with its own engine (rollout.engine.* holds its options)"
OLD_LOGPROB = (
    "the old-log-prob pass always packs by tokens: actor.log_prob_max_tokens_per_gpu "
    "(null: derived from the memory plan, else the actor's update batching)"
)
REWARD_MODEL = "not used: hybridflow's reward model is set by reward.model.* (docs/rewards.md)"
MEGATRON = "Megatron-LM option"
PIPELINE = "Megatron-LM pipeline parallelism (hybridflow splits layers by tensor parallelism)"


def _no_pipeline(value) -> bool:
    return value in (None, 1, "null", "None")


def _parallel_entries(verl: str, ours: str) -> list[Entry]:
    """A training role's layout keys: Ulysses and the Megatron-style sizes that map onto
    ours (``verl`` is the role's prefix, ``ours`` its section); what does not map stops."""
    mega = verl + "megatron."
    return [
        Rename(verl + "ulysses_sequence_parallel_size", f"{ours}.sequence_parallel_size"),
        Ignored(
            verl + "strategy",
            "trains with FSDP2, tensor, sequence and expert parallel "
            f"as {ours}.*_parallel_size say (the megatron.* sizes map onto them)",
        ),  # fmt: skip
        Rename(mega + "tensor_model_parallel_size", f"{ours}.tensor_parallel_size"),
        Rename(mega + "expert_model_parallel_size", f"{ours}.expert_parallel_size"),
        Unsupported(mega + "pipeline_model_parallel_size", PIPELINE, _one, "1"),
        Unsupported(
            mega + "virtual_pipeline_model_parallel_size", PIPELINE, _no_pipeline, "null"
        ),  # fmt: skip
        Unsupported(
            mega + "context_parallel_size",
            "ring context parallelism (ulysses_sequence_parallel_size splits long sequences)",
            _one,
            "1",
        ),
        Unsupported(
            mega + "expert_tensor_parallel_size",
            "a tensor-parallel size of its own for the experts (they are split by "
            "tensor_model_parallel_size like the other layers: Megatron's null)",
            lambda v: v in (None, "null", "None"),
            "null",
        ),
        Ignored(
            mega + "sequence_parallel",
            "the tensor-parallel layers choose how activations are split between them",
        ),  # fmt: skip
        Ignored(mega + "use_distributed_optimizer", "FSDP2 shards the optimizer state"),
        Ignored(mega + "seed", "initialisation and sampling follow trainer.seed"),
        *_megatron_memory_entries(mega, ours),
        Unsupported(mega + "*", MEGATRON),
    ]


WEIGHTS_FROM_PATH = "weights load from model.path (Hugging Face safetensors)"
RECOMPUTE = "gradient checkpointing recomputes every layer (model.gradient_checkpointing)"


def _megatron_memory_entries(mega: str, ours: str) -> list[Entry]:
    """Megatron's offload, recompute and checkpoint-format keys that map onto ours: CPU
    offload of the role's state (FSDP2's, one key for weights, gradients and optimizer
    state), recomputation as gradient checkpointing; the rest is said to have no effect."""
    override = mega + "override_transformer_config."
    entries: list[Entry] = [
        Ignored(mega + "use_dist_checkpointing", WEIGHTS_FROM_PATH),
        Ignored(mega + "dist_checkpointing_path", WEIGHTS_FROM_PATH),
        Ignored(mega + "use_mbridge", WEIGHTS_FROM_PATH),
        Ignored(override + "num_layers_in_first_pipeline_stage", f"applies to {PIPELINE}"),
        Ignored(override + "num_layers_in_last_pipeline_stage", f"applies to {PIPELINE}"),
        Ignored(override + "recompute_method", RECOMPUTE),
        Ignored(override + "recompute_num_layers", RECOMPUTE),
    ]
    entries += _megatron_fp8_entries(override, ours)
    if ours in ("actor", "ref"):
        entries.append(Rename(mega + "param_offload", f"{ours}.param_offload"))
    if ours == "actor":
        offloaded = (
            "FSDP2's CPU offload (actor.param_offload) keeps it on the host with the weights"
        )
        entries += [
            Ignored(mega + "grad_offload", offloaded),
            Ignored(mega + "optimizer_offload", offloaded),
            Rename(override + "recompute_granularity", "model.gradient_checkpointing",
                   cv.recompute, "full or selective -> true"),
        ]  # fmt: skip
    else:
        entries.append(Ignored(override + "recompute_granularity", RECOMPUTE))
    return entries


def _megatron_fp8_entries(override: str, ours: str) -> list[Entry]:
    """Transformer Engine's FP8 training keys -> ``{ours}.precision`` and ``fp8_recipe``
    (torchao's float8 training here, learners/fp8_training.py); the reference only runs
    forward passes and stays bf16."""
    if ours == "ref":
        return [Ignored(override + "fp8", "the reference policy's forward stays bf16"),
                Ignored(override + "fp8_recipe", "the reference policy's forward stays bf16")]  # fmt: skip
    return [
        Rename(override + "fp8", f"{ours}.precision", cv.fp8_precision,
               "e4m3 or hybrid -> fp8; the gradient format follows the recipe"),
        Rename(override + "fp8_recipe", f"{ours}.fp8_recipe", cv.fp8_recipe,
               "tensorwise and delayed -> tensorwise, blockwise -> rowwise"),
        Ignored(override + "fp8_param", FP8_MASTERS),
        Ignored(override + "fp8_param_gather", FP8_MASTERS),
    ]  # fmt: skip


FP8_MASTERS = (
    "masters stay fp32; under FSDP2 the tensorwise recipe all-gathers the weights in float8"
)


def _model_entries(prefix: str, ours: str) -> list[Entry]:
    """Entries shared by the actor's and the critic's ``model.*`` keys."""
    return [
        Ignored(prefix + "use_remove_padding", PACKED),
        Ignored(prefix + "use_shm", "weights are read from their local path"),
        Ignored(prefix + "trust_remote_code", "no model code is downloaded or run"),
        Unsupported(prefix + "external_lib", "external model libraries", _off, "null"),
        Unsupported(prefix + "override_config", "overriding the model's config.json", _off, "{}"),
        Unsupported(prefix + "override_config.*", "overriding the model's config.json"),
        Unsupported(prefix + "enable_activation_offload", "activation offload", _off, "False"),
        Unsupported(prefix + "tiled_mlp.enabled", "TiledMLP", _off, "False"),
        Ignored(prefix + "tiled_mlp.*", "applies only with tiled_mlp.enabled=True"),
        Ignored(prefix + "fused_kernel_options.*", "hybridflow's own kernels are always used"),
        Ignored(prefix + "use_fused_kernels", "hybridflow's own kernels are always used"),
        Ignored(prefix + "use_liger", "hybridflow's own kernels are always used"),
        Ignored(prefix + "hf_config_path", f"the config.json beside {ours} is used"),
    ]


MODEL_TABLE: list[Entry] = [
    Rename(MODEL + "path", "model.path"),
    Rename(MODEL + "tokenizer_path", "model.tokenizer_path"),
    Rename(MODEL + "enable_gradient_checkpointing", "model.gradient_checkpointing"),
    Rename(MODEL + "lora_rank", "model.lora_rank"),
    Rename(MODEL + "lora.rank", "model.lora_rank"),
    Rename(MODEL + "lora_alpha", "model.lora_alpha"),
    Rename(MODEL + "lora.alpha", "model.lora_alpha"),
    Rename(
        MODEL + "target_modules",
        "model.lora_target_modules",
        cv.lora_targets,
        "all-linear -> the 7 projections of a decoder layer",
    ),
    Unsupported(MODEL + "lora_adapter_path", "starting from a saved LoRA adapter", _off, "null"),
    Unsupported(MODEL + "exclude_modules", "excluding modules from LoRA", _off, "null"),
    Ignored(MODEL + "lora.*", "LoRA adapters are initialised as peft does"),
    Unsupported(MODEL + "custom_chat_template", "a custom chat template", _off, "null"),
    Unsupported(MODEL + "mtp.enable", "multi-token prediction (MTP)", _off, "False"),
    Ignored(MODEL + "mtp.*", "applies only with mtp.enable=True"),
    *_model_entries(MODEL, "model.path"),
]

OPTIM_TABLE: list[Entry] = [
    Rename(ACTOR + "optim.lr", "actor.lr"),
    Rename(ACTOR + "optim.weight_decay", "actor.weight_decay"),
    Rename(ACTOR + "optim.betas", "actor.betas"),
    Rename(ACTOR + "optim.clip_grad", "actor.grad_clip"),
    Rename(ACTOR + "optim.min_lr_ratio", "actor.min_lr_ratio"),
    Rename(ACTOR + "optim.lr_scheduler_type", "actor.lr_scheduler", cv.lr_schedule),
    Rename(ACTOR + "optim.warmup_style", "actor.lr_scheduler", cv.lr_schedule),
    Rename(ACTOR + "optim.lr_decay_style", "actor.lr_scheduler", cv.lr_schedule),
    Unsupported(
        ACTOR + "optim.num_cycles",
        "cosine schedules other than one half cycle",
        lambda v: v in (None, 0.5),
        "0.5",
    ),
    Unsupported(
        ACTOR + "optim.optimizer",
        "optimizers other than AdamW",
        lambda v: str(v).lower() == "adamw",
        "AdamW",
    ),
    Ignored(ACTOR + "optim.optimizer_impl", "torch.optim.AdamW is used"),
    Ignored(ACTOR + "optim.total_training_steps", "set from the run length"),
    Unsupported(
        ACTOR + "optim.override_optimizer_config", "Megatron optimizer options", _off, "null"
    ),
    Ignored(
        ACTOR + "optim.override_optimizer_config.fp8_recipe",
        "AdamW state stays fp32 (actor.precision=fp8 changes the matmuls, not the optimizer)",
    ),  # fmt: skip
    Unsupported(ACTOR + "optim.override_optimizer_config.*", "Megatron optimizer options"),
]

ACTOR_TABLE: list[Entry] = [
    Rename(ACTOR + "ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    Rename(ACTOR + "ppo_epochs", "actor.ppo_epochs"),
    Rename(ACTOR + "shuffle", "actor.shuffle"),
    Rename(ACTOR + "clip_ratio_c", "actor.clip_ratio_c"),
    Rename(ACTOR + "loss_agg_mode", "actor.loss_agg_mode"),
    Rename(ACTOR + "entropy_coeff", "actor.entropy_coeff"),
    Rename(ACTOR + "use_kl_loss", "actor.use_kl_loss"),
    Rename(ACTOR + "kl_loss_coef", "actor.kl_loss_coef"),
    Rename(ACTOR + "kl_loss_type", "actor.kl_loss_type"),
    Rename(ACTOR + "grad_clip", "actor.grad_clip"),
    Rename(ACTOR + "fsdp_config.param_offload", "actor.param_offload"),
    Rename(ACTOR + "fsdp_config.optimizer_offload", "actor.optimizer_offload"),
    Ignored(
        ACTOR + "fsdp_config.*", "FSDP2 sharding, wrapping and precision are set by hybridflow"
    ),
    *_parallel_entries(ACTOR, "actor"),
    Rename(ACTOR + "freeze_vision_tower", "actor.freeze_vision_tower"),
    Rename(MODEL + "freeze_vision_tower", "actor.freeze_vision_tower"),  # newer verl's place
    Unsupported(ACTOR + "loss_scale_factor", "a fixed loss scale factor", _off, "null"),
    Ignored(ACTOR + "router_replay.*", "the engine hands the routes over in memory (no files)"),
    Rename(
        ACTOR + "use_torch_compile",
        "model.compile",
        cv.torch_compile,
        how="True becomes auto: compiled when training on CUDA, as verl does, not on the CPU",
    ),
    Ignored(ACTOR + "entropy_from_logits_with_chunking", CHUNKED),
    Ignored(ACTOR + "entropy_checkpointing", CHUNKED),
    Ignored(ACTOR + "calculate_entropy", "entropy is logged whenever old log-probs are computed"),
    Ignored(ACTOR + "calculate_sum_pi_squared", "not computed here"),
    Ignored(ACTOR + "sum_pi_squared_checkpointing", "not computed here"),
    Ignored(ACTOR + "use_prefix_grouper", "each sample is packed whole"),
    Ignored(ACTOR + "use_remove_padding", PACKED),
    Ignored(ACTOR + "use_fused_kernels", "hybridflow's own kernels are always used"),
    Rename(ACTOR + "checkpoint.async_save", "trainer.async_save"),
    Ignored(ACTOR + "checkpoint.*", "a checkpoint always holds the model, optimizer and state"),
    Ignored(ACTOR + "profiler.*", PROFILER),
    Ignored(ACTOR + "data_loader_seed", "data order follows trainer.seed"),
    Ignored(ACTOR + "rollout_n", "derived from rollout.n"),
]

REF_TABLE: list[Entry] = [
    Rename(REF + "fsdp_config.param_offload", "ref.param_offload"),
    Ignored(REF + "fsdp_config.*", "FSDP2 sharding, wrapping and precision are set by hybridflow"),
    *_parallel_entries(REF, "ref"),
    Ignored(
        REF + "use_torch_compile",
        "the reference runs uncompiled (model.compile applies to the actor)",
    ),
    Ignored(REF + "entropy_from_logits_with_chunking", CHUNKED),
    Ignored(REF + "entropy_checkpointing", CHUNKED),
    Ignored(REF + "router_replay.*", "MoE router replay is not used"),
    Ignored(REF + "profiler.*", PROFILER),
    Ignored(REF + "rollout_n", "derived from rollout.n"),
]

ROLLOUT_TABLE: list[Entry] = [
    Rename(ROLLOUT + "n", "rollout.n"),
    Rename(ROLLOUT + "top_k", "rollout.top_k"),
    Rename(ROLLOUT + "top_p", "rollout.top_p"),
    Rename(ROLLOUT + "ignore_eos", "rollout.ignore_eos"),
    Rename(ROLLOUT + "max_num_seqs", "rollout.max_num_seqs"),
    Rename(
        ROLLOUT + "gpu_memory_utilization",
        "rollout.gpu_memory_utilization",
        how="vLLM: share of all GPU memory; here: share of the memory free for the KV cache",
    ),
    Rename(
        ROLLOUT + "free_cache_engine",
        "rollout.release_cache",
        how="the KV cache only: vLLM's sleep frees its weights too, which here is "
        "rollout.release_weights=true",
    ),
    Rename(
        ROLLOUT + "enforce_eager",
        "rollout.engine.cuda_graphs",
        cv.enforce_eager,
        "True -> false (no CUDA graphs); False -> null (graphs on CUDA)",
    ),
    Ignored(ROLLOUT + "name", ENGINE),
    Ignored(ROLLOUT + "mode", "requests always join one continuously batched engine"),
    Ignored(ROLLOUT + "dtype", "the engine runs in model.dtype"),
    Ignored(ROLLOUT + "load_format", "the engine reads the actor's weights; none are loaded"),
    Ignored(ROLLOUT + "layered_summon", "weights are synced in place or in buckets"),
    Ignored(ROLLOUT + "multi_stage_wake_up", "the KV cache is re-allocated in one step"),
    Ignored(ROLLOUT + "prompt_length", "follows data.max_prompt_length"),
    Ignored(ROLLOUT + "response_length", "follows data.max_response_length"),
    Ignored(
        ROLLOUT + "enable_chunked_prefill", "prefill is packed (rollout.engine.max_prefill_tokens)"
    ),
    Ignored(ROLLOUT + "enable_prefix_caching", "each prompt is prefilled once for its n samples"),
    Ignored(
        ROLLOUT + "max_num_batched_tokens", "prefill is packed (rollout.engine.max_prefill_tokens)"
    ),
    Ignored(ROLLOUT + "max_model_len", "the KV cache is sized from the data lengths"),
    Ignored(ROLLOUT + "cudagraph_capture_sizes", "graphs are captured per batch-size bucket"),
    Ignored(ROLLOUT + "disable_log_stats", ENGINE),
    Ignored(ROLLOUT + "logprobs_mode", "rollout log-probs are those of the sampled distribution"),
    Ignored(ROLLOUT + "scheduling_policy", "requests are served first come, first served"),
    Ignored(ROLLOUT + "skip_tokenizer_init", "the engine works on token ids only"),
    Ignored(ROLLOUT + "calculate_log_probs", "rollout log-probs are always kept"),
    Ignored(ROLLOUT + "engine_kwargs.*", "options of vLLM / SGLang / TensorRT-LLM; " + ENGINE),
    Ignored(ROLLOUT + "checkpoint_engine.*", "weights are synced in place or in buckets"),
    Ignored(ROLLOUT + "agent.*", "verl's agent-loop workers; multi-turn runs use rollout.agent.*"),
    Ignored(ROLLOUT + "trace.*", "rollout tracing is not configured here"),
    Ignored(ROLLOUT + "prometheus.*", "no Prometheus metrics"),
    Ignored(ROLLOUT + "profiler.*", PROFILER),
    Ignored(ROLLOUT + "log_prob_micro_batch_size", OLD_LOGPROB),
    Ignored(ROLLOUT + "log_prob_micro_batch_size_per_gpu", OLD_LOGPROB),
    Ignored(ROLLOUT + "log_prob_use_dynamic_bsz", OLD_LOGPROB),
    Rename(
        ROLLOUT + "log_prob_max_token_len_per_gpu",
        "actor.log_prob_max_tokens_per_gpu",
        how="used with or without log_prob_use_dynamic_bsz: the pass always packs by tokens",
    ),
    Ignored(ROLLOUT + "multi_turn.format", "tool calls use the Hermes format"),
    Unsupported(
        ROLLOUT + "multi_turn.enable",
        "verl's multi-turn config (hybridflow's tool episodes: rollout.agent.*)",
        _off,
        "False",
    ),
    Unsupported(
        ROLLOUT + "multi_turn.*",
        "verl's multi-turn config (hybridflow's tool episodes: rollout.agent.*)",
        _off,
        "null",
    ),
    Unsupported(
        ROLLOUT + "over_sample_rate", "over-sampling and aborting slow rollouts", _off, "0"
    ),
    Unsupported(ROLLOUT + "data_parallel_size", "data parallelism inside one engine", _one, "1"),
    Rename(
        ROLLOUT + "expert_parallel_size",
        "rollout.expert_parallel_size",
        cv.rollout_expert_parallel,
        "1 -> unset (the experts split whole over the rollout's tensor-parallel ranks, the "
        "bytes a rank of vLLM's width split holds); larger: as given",
    ),
    Unsupported(ROLLOUT + "pipeline_model_parallel_size", "pipeline-parallel rollout", _one, "1"),
    Unsupported(ROLLOUT + "quantization", "quantized rollout", _off, "null"),
    Unsupported(ROLLOUT + "quantization_config_file", "quantized rollout", _off, "null"),
    Unsupported(ROLLOUT + "skip_rollout", "replaying dumped rollouts", _off, "False"),
    Ignored(ROLLOUT + "skip_dump_dir", "applies only with skip_rollout=True"),
]

CRITIC_TABLE: list[Entry] = [
    Rename("critic.optim.lr", "critic.lr"),
    Rename("critic.optim.clip_grad", "critic.grad_clip"),
    Ignored("critic.optim.weight_decay", "the critic's AdamW has no weight decay here"),
    Ignored("critic.optim.*", "the critic's AdamW runs at a constant rate after its warm-up"),
    Rename("critic.model.path", "critic.path"),
    Ignored("critic.model.tokenizer_path", "the critic reads the policy's token ids"),
    Ignored("critic.model.enable_gradient_checkpointing", "model.gradient_checkpointing applies"),
    Unsupported("critic.model.fsdp_config.param_offload", "critic offload", _off, "False"),
    Unsupported("critic.model.fsdp_config.optimizer_offload", "critic offload", _off, "False"),
    Ignored("critic.model.fsdp_config.*", "FSDP2 is configured by hybridflow"),
    Unsupported("critic.model.lora_rank", "LoRA on the critic", _off, "0"),
    Ignored("critic.model.lora_alpha", "applies only with critic LoRA"),
    Ignored("critic.model.target_modules", "applies only with critic LoRA"),
    *_model_entries("critic.model.", "critic.path"),
    *_parallel_entries("critic.", "critic"),
    Ignored("critic.enable", "a critic runs exactly when algorithm.adv_estimator=gae"),
    Ignored("critic.shuffle", "the critic's mini-batches are taken in order"),
    Ignored("critic.data_loader_seed", "data order follows trainer.seed"),
    Ignored("critic.checkpoint.*", "a checkpoint always holds the critic and its optimizer"),
    Ignored("critic.profiler.*", PROFILER),
    Ignored("critic.rollout_n", "derived from rollout.n"),
]

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
    Unsupported("algorithm.use_pf_ppo", "PF-PPO (reward-weighted resampling)", _off, "False"),
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
    Unsupported("data.custom_cls.path", "custom dataset classes", _off, "null"),
    Ignored("data.custom_cls.name", "applies only with data.custom_cls.path"),
    Unsupported("data.sampler.class_path", "custom samplers (curricula)", _off, "null"),
    Ignored("data.sampler.class_name", "applies only with data.sampler.class_path"),
    Unsupported("data.datagen.path", "generated datasets", _off, "null"),
    Ignored("data.datagen.name", "applies only with data.datagen.path"),
    Unsupported(
        "data.tool_config_path",
        "verl's tool config (hybridflow: rollout.agent.tools)",
        _off,
        "null",
    ),
    Unsupported("data.apply_chat_template_kwargs.*", "chat template keyword arguments"),
]

REWARD_TABLE: list[Entry] = [
    Rename("reward_model.reward_manager", "reward.manager"),
    Rename("reward_manager.name", "reward.manager"),
    Ignored("reward_manager.source", "reward managers are named by reward.manager"),
    Unsupported("reward_manager.module.path", "custom reward manager classes", _off, "null"),
    Ignored("reward_manager.module.*", "applies only with reward_manager.module.path"),
    Ignored("reward_model.reward_kwargs.max_resp_len", "follows data.max_response_length"),
    Unsupported("reward_model.reward_kwargs.*", "reward manager keyword arguments"),
    Ignored("reward_model.launch_reward_fn_async", "scoring runs in reward.num_workers processes"),
    Unsupported(
        "reward_model.sandbox_fusion.url",
        "SandboxFusion (code rewards run in hybridflow's local sandbox)",
        _off,
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
        "trainer.critic_warmup", "critic warm-up (actor updates held for N steps)", _off, "0"
    ),
    Ignored("trainer.balance_batch", "micro-batches are always balanced by tokens across ranks"),
    Ignored("trainer.log_val_generations", "validation generations are not logged"),
    Rename("trainer.rollout_data_dir", "trainer.rollout_data_dir"),
    Unsupported("trainer.validation_data_dir", "dumping validation generations", _off, "null"),
    Unsupported("trainer.default_hdfs_dir", "copying checkpoints to HDFS", _off, "null"),
    Ignored("trainer.del_local_ckpt_after_load", "checkpoints are kept per trainer.keep_last_k"),
    Unsupported("trainer.val_only", "validation-only runs", _off, "False"),
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
    Unsupported("transfer_queue.enable", "TransferQueue", _off, "False"),
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
