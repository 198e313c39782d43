"""A run's memory plan read off its config: what the workers will allocate (PlanOptions),
and the actor's update budget when actor.max_tokens_per_gpu=auto. memory_check.py checks the
plan against the GPU; memory_fixes.py says what would make one that does not fit fit."""

from __future__ import annotations

import copy
import dataclasses
import math

from hybridflow.config import Config, Derived, apply_mapping, validate
from hybridflow.config.rollout_section import kv_memory_share
from hybridflow.config.sections import UNPLANNED_UPDATE_BUDGET
from hybridflow.parallel.roles import sizes_of
from hybridflow.trainer.plan import memory_choices as choices
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_choices import (
    choose_checkpointing,
)
from hybridflow.trainer.plan.memory_plan import MemoryPlan, PlanOptions
from hybridflow.trainer.plan.memory_render import gib
from hybridflow.trainer.plan.memory_reward_model import (
    reward_model_options,
)
from hybridflow.trainer.plan.memory_vision import image_patches

# model.dtype -> bytes of (trained weights, rollout and reference weights) on a GPU
# (workers/model_loading.training_dtype and resolve_dtype).
DTYPE_BYTES = {"auto": (4, 2), "float32": (4, 4), "bfloat16": (2, 2), "float16": (2, 2)}


def model_architecture_for(cfg: Config):
    """(name, ModelArchitecture) of the policy without loading it; ``sft:<task>`` plans the
    ``sft.preset`` shape it is trained from. None when the shape is unknown."""
    from hybridflow.models.presets import PRESETS
    from hybridflow.trainer.plan.architecture import model_architecture

    path = cfg.model.path
    if path.startswith("sft:"):
        return (cfg.sft.preset, PRESETS[cfg.sft.preset]) if cfg.sft.preset in PRESETS else None
    architecture = model_architecture(path)
    return None if architecture is None else (path, architecture)


def plan_options(cfg: Config, derived: Derived, gpu_bytes: int | None) -> PlanOptions:
    """What the workers will allocate, read off the config (trainer/plan/memory_plan.py says how
    each option maps onto memory)."""
    m, a, r, t = cfg.model, cfg.actor, cfg.rollout, cfg.trainer
    master_bytes, rollout_bytes = DTYPE_BYTES.get(m.dtype, (4, 2))
    max_len = derived.max_sequence_length
    micro_tokens = a.max_tokens_per_gpu or a.micro_batch_size_per_gpu * max_len
    if a.max_tokens_per_gpu is not None:  # packed: at worst every sample at full length
        micro_batches = math.ceil(derived.mini_batch_samples_per_gpu * max_len / micro_tokens)
    else:
        micro_batches = derived.micro_batches_per_mini_batch or 1
    reference = "none"
    if derived.use_reference:
        reference = "actor" if m.lora_rank > 0 and cfg.ref.path is None else "own"
    critic_tokens = (cfg.critic.max_tokens_per_gpu
                     or cfg.critic.micro_batch_size_per_gpu * max_len)  # fmt: skip
    actor, rollout = sizes_of(cfg, "actor"), sizes_of(cfg, "rollout")
    # a tensor-parallel rollout fuses its shard's projections, one with experts over
    # replicas too (the fused layers dispatch by all-to-all: engine/layers/moe.py)
    unfused = r.engine.decode_backend == "torch" or r.lora_in_place and m.lora_rank > 0
    fuse = "none" if unfused else r.engine.fuse_projections
    # a vision-language model: its images' patches; under sequence parallelism every rank of
    # the group encodes the whole images of the group's micro-batch (sp times a rank's tokens:
    # learners/sharding/sequence_shard.py)
    named = model_architecture_for(cfg)
    patches = 0 if named is None else image_patches(named[1], micro_tokens * actor["sp"],
                                                    cfg.data.max_prompt_length / max_len)  # fmt: skip
    return PlanOptions(
        master_bytes=master_bytes,
        compute_bytes=2,
        rollout_bytes=rollout_bytes,
        reference_bytes=rollout_bytes,
        lora_rank=m.lora_rank,
        lora_targets=tuple(m.lora_target_modules),
        train_gpus=training_gpus(cfg, derived),
        host_gpus=t.n_gpus_per_node,
        tp=actor["tp"],
        sp=actor["sp"],
        ep=actor["ep"],
        rollout_tp=rollout["tp"],
        rollout_experts_whole=r.expert_parallel_size == 1 and rollout["tp"] > 1,
        rollout_ep=rollout["ep"] if rollout["ep"] > rollout["tp"] else 1,
        rollout_release_weights=r.release_weights,
        param_offload=a.param_offload,
        optimizer_offload=a.optimizer_offload,
        gradient_checkpointing=m.gradient_checkpointing is True,  # auto: plan_for_config
        # model.compile=auto compiles on CUDA (trainer/loop/compile_policy.py)
        compiled_layers=m.compile is True or (m.compile == "auto" and t.device != "cpu"),
        micro_batch_tokens=micro_tokens,
        micro_batches=max(micro_batches, 1),
        rollout_max_seqs=r.max_num_seqs,
        rollout_max_seq_len=max_len,
        kv_block_size=r.engine.kv_block_size,
        cap_state_slots=r.engine.cap_state_slots,
        gpu_memory_utilization=kv_memory_share(r, t),
        # partial rollouts: requests stay in flight while the actor trains, the cache with them
        release_cache=r.release_cache and not (t.mode == "async" and t.partial_rollout),
        fuse_projections=fuse,
        rollout_fp8=r.dtype == "fp8",
        kv_cache_fp8=r.engine.kv_cache_dtype == "fp8",
        max_prefill_tokens=r.engine.max_prefill_tokens,
        split=t.placement == "split",
        rollout_beside_update=t.mode == "async" and (t.max_staleness > 0 or t.partial_rollout),
        lora_in_place=r.lora_in_place,
        reference=reference,
        reference_offload=cfg.ref.param_offload,
        critic=derived.use_critic,
        critic_micro_batch_tokens=critic_tokens,
        **reward_model_options(cfg),
        gpu_bytes=gpu_bytes,
        freeze_vision_tower=a.freeze_vision_tower,
        image_patches=patches,
    )


def training_gpus(cfg: Config, derived: Derived) -> int:
    """The actor's GPUs: all of them, less the rollout's own with split placement."""
    split = cfg.trainer.placement == "split"
    return derived.world_size - (cfg.trainer.rollout_gpus if split else 0)


def plan_for_config(
    cfg: Config, derived: Derived | None = None, gpu_bytes: int | None = None
) -> MemoryPlan | None:
    """The plan of this run on GPUs of ``gpu_bytes`` each; None when the model's shape is
    unknown (an unreadable config.json)."""
    found = model_architecture_for(cfg)
    if found is None:
        return None
    derived = derived or validate(cfg)
    if cfg.actor.max_tokens_per_gpu == "auto":
        cfg = with_changes(cfg, update_budget_changes(cfg, derived, gpu_bytes)[0])
        derived = validate(cfg)
    name, architecture = found
    options = plan_options(cfg, derived, gpu_bytes)
    if cfg.model.gradient_checkpointing == "auto" and gpu_bytes is not None:
        choice = choose_checkpointing(name, architecture, options)
        options = dataclasses.replace(options, gradient_checkpointing=choice.on)
    return mp.build_plan(name, architecture, options)


def update_budget_changes(
    cfg: Config, derived: Derived, gpu_bytes: int | None
) -> tuple[dict[str, object], list[str]]:
    """actor.max_tokens_per_gpu=auto resolved, with model.gradient_checkpointing when that is
    auto too (memory_choices.choose_update_budget), and a line saying so on a GPU; ({}, [])
    when the budget is set."""
    m, a = cfg.model, cfg.actor
    if a.max_tokens_per_gpu != "auto":
        return {}, []
    max_len = derived.max_sequence_length
    found = model_architecture_for(cfg)
    if gpu_bytes is None or found is None:
        tokens = max(UNPLANNED_UPDATE_BUDGET, choices.round_up(max_len))
        lines = [] if gpu_bytes is None else [
            f"actor.max_tokens_per_gpu=auto: {tokens:,} tokens (the model's shape is unknown, "
            f"so is its update's memory)"]  # fmt: skip
        return {"actor.max_tokens_per_gpu": tokens}, lines
    name, architecture = found

    def update_bytes(tokens: int, checkpointing: bool) -> int:
        options = plan_options(with_changes(cfg, {"actor.max_tokens_per_gpu": tokens}), derived,
                               gpu_bytes)  # fmt: skip
        options = dataclasses.replace(options, gradient_checkpointing=checkpointing)
        return mp.build_plan(name, architecture, options).phase_bytes(mp.UPDATE)

    batch_tokens = derived.mini_batch_samples_per_gpu * max_len
    choice = choices.choose_update_budget(update_bytes, gpu_bytes, m.gradient_checkpointing,
                                          max_len, batch_tokens)  # fmt: skip
    changes: dict[str, object] = {"actor.max_tokens_per_gpu": choice.tokens}
    if m.gradient_checkpointing == "auto":
        changes["model.gradient_checkpointing"] = choice.checkpointing
    recompute = "with" if choice.checkpointing else "without"
    why = (f"the most, up to {choices.UPDATE_BUDGET_CAP:,}, whose update fits under "
           f"{gib(choice.limit)} {recompute} gradient checkpointing") if choice.fits else (
           f"one sequence; not even its update fits under {gib(choice.limit)}")  # fmt: skip
    auto = "; model.gradient_checkpointing=auto: " + ("on" if choice.checkpointing else "off")
    return changes, [f"actor.max_tokens_per_gpu=auto: {choice.tokens:,} tokens ({why})"
                     f"{auto if m.gradient_checkpointing == 'auto' else ''}"]  # fmt: skip


def with_changes(cfg: Config, changes: dict[str, object]) -> Config:
    """A copy of cfg with the dotted keys set."""
    changed = copy.deepcopy(cfg)
    for key, value in changes.items():
        nested: object = value
        for name in reversed(key.split(".")[1:]):
            nested = {name: nested}
        problems = apply_mapping(changed, {key.split(".")[0]: nested}, source="memory plan")
        assert not problems, problems  # the candidates are valid keys and values
    return changed
