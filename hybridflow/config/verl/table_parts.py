"""What the verl mapping tables share: verl's key prefixes, the tests a value passes where a
feature we lack is off, the reasons several entries give, and the entries every training role
(actor, reference, critic) has for its layout, memory and model keys."""

from __future__ import annotations

from hybridflow.config.verl import converters as cv
from hybridflow.config.verl.rules import Entry, Ignored, Rename, Unsupported

ARR = "actor_rollout_ref."
MODEL, ACTOR, REF, ROLLOUT = ARR + "model.", ARR + "actor.", ARR + "ref.", ARR + "rollout."


def is_off(value) -> bool:
    """An Unsupported key's check: the value leaves the feature off (verl's null, false, 0,
    an empty mapping or list, as YAML or a command line writes them)."""
    return value in (None, False, "false", "False", 0, {}, [])


def is_one(value) -> bool:
    """An Unsupported size's check: unset or 1 (nothing split that way)."""
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


def parallel_entries(verl: str, ours: str) -> list[Entry]:
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
        Unsupported(mega + "pipeline_model_parallel_size", PIPELINE, is_one, "1"),
        Unsupported(
            mega + "virtual_pipeline_model_parallel_size", PIPELINE, _no_pipeline, "null"
        ),  # fmt: skip
        Unsupported(
            mega + "context_parallel_size",
            "ring context parallelism (ulysses_sequence_parallel_size splits long sequences)",
            is_one,
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


def model_entries(prefix: str, ours: str) -> list[Entry]:
    """Entries shared by the actor's and the critic's ``model.*`` keys."""
    return [
        Ignored(prefix + "use_remove_padding", PACKED),
        Ignored(prefix + "use_shm", "weights are read from their local path"),
        Ignored(prefix + "trust_remote_code", "no model code is downloaded or run"),
        Unsupported(prefix + "external_lib", "external model libraries", is_off, "null"),
        Unsupported(prefix + "override_config", "overriding the model's config.json", is_off, "{}"),
        Unsupported(prefix + "override_config.*", "overriding the model's config.json"),
        Unsupported(prefix + "enable_activation_offload", "activation offload", is_off, "False"),
        Unsupported(prefix + "tiled_mlp.enabled", "TiledMLP", is_off, "False"),
        Ignored(prefix + "tiled_mlp.*", "applies only with tiled_mlp.enabled=True"),
        Ignored(prefix + "fused_kernel_options.*", "hybridflow's own kernels are always used"),
        Ignored(prefix + "use_fused_kernels", "hybridflow's own kernels are always used"),
        Ignored(prefix + "use_liger", "hybridflow's own kernels are always used"),
        Ignored(prefix + "hf_config_path", f"the config.json beside {ours} is used"),
    ]
