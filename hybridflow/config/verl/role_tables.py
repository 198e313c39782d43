"""The verl mapping table's entries for the model, the actor (its optimizer too), the
reference, the rollout and the critic; table.py puts them first in TABLE."""

from __future__ import annotations

from hybridflow.config.verl import converters as cv
from hybridflow.config.verl.rules import Entry, Ignored, Rename, Unsupported
from hybridflow.config.verl.table_parts import (
    ACTOR,
    CHUNKED,
    ENGINE,
    MODEL,
    OLD_LOGPROB,
    PACKED,
    PROFILER,
    REF,
    ROLLOUT,
    is_off,
    is_one,
    model_entries,
    parallel_entries,
)

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
    Unsupported(MODEL + "lora_adapter_path", "starting from a saved LoRA adapter", is_off, "null"),
    Unsupported(MODEL + "exclude_modules", "excluding modules from LoRA", is_off, "null"),
    Ignored(MODEL + "lora.*", "LoRA adapters are initialised as peft does"),
    Unsupported(MODEL + "custom_chat_template", "a custom chat template", is_off, "null"),
    Unsupported(MODEL + "mtp.enable", "multi-token prediction (MTP)", is_off, "False"),
    Ignored(MODEL + "mtp.*", "applies only with mtp.enable=True"),
    *model_entries(MODEL, "model.path"),
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
        ACTOR + "optim.override_optimizer_config", "Megatron optimizer options", is_off, "null"
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
    *parallel_entries(ACTOR, "actor"),
    Rename(ACTOR + "freeze_vision_tower", "actor.freeze_vision_tower"),
    Rename(MODEL + "freeze_vision_tower", "actor.freeze_vision_tower"),  # newer verl's place
    Unsupported(ACTOR + "loss_scale_factor", "a fixed loss scale factor", is_off, "null"),
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
    *parallel_entries(REF, "ref"),
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
        is_off,
        "False",
    ),
    Unsupported(
        ROLLOUT + "multi_turn.*",
        "verl's multi-turn config (hybridflow's tool episodes: rollout.agent.*)",
        is_off,
        "null",
    ),
    Unsupported(
        ROLLOUT + "over_sample_rate", "over-sampling and aborting slow rollouts", is_off, "0"
    ),
    Unsupported(ROLLOUT + "data_parallel_size", "data parallelism inside one engine", is_one, "1"),
    Rename(
        ROLLOUT + "expert_parallel_size",
        "rollout.expert_parallel_size",
        cv.rollout_expert_parallel,
        "1 -> unset (the experts split whole over the rollout's tensor-parallel ranks, the "
        "bytes a rank of vLLM's width split holds); larger: as given",
    ),
    Unsupported(ROLLOUT + "pipeline_model_parallel_size", "pipeline-parallel rollout", is_one, "1"),
    Unsupported(ROLLOUT + "quantization", "quantized rollout", is_off, "null"),
    Unsupported(ROLLOUT + "quantization_config_file", "quantized rollout", is_off, "null"),
    Unsupported(ROLLOUT + "skip_rollout", "replaying dumped rollouts", is_off, "False"),
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
    Unsupported("critic.model.fsdp_config.param_offload", "critic offload", is_off, "False"),
    Unsupported("critic.model.fsdp_config.optimizer_offload", "critic offload", is_off, "False"),
    Ignored("critic.model.fsdp_config.*", "FSDP2 is configured by hybridflow"),
    Unsupported("critic.model.lora_rank", "LoRA on the critic", is_off, "0"),
    Ignored("critic.model.lora_alpha", "applies only with critic LoRA"),
    Ignored("critic.model.target_modules", "applies only with critic LoRA"),
    *model_entries("critic.model.", "critic.path"),
    *parallel_entries("critic.", "critic"),
    Ignored("critic.enable", "a critic runs exactly when algorithm.adv_estimator=gae"),
    Ignored("critic.shuffle", "the critic's mini-batches are taken in order"),
    Ignored("critic.data_loader_seed", "data order follows trainer.seed"),
    Ignored("critic.checkpoint.*", "a checkpoint always holds the critic and its optimizer"),
    Ignored("critic.profiler.*", PROFILER),
    Ignored("critic.rollout_n", "derived from rollout.n"),
]
