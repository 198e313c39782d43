"""``validate(cfg)``: every rule checked at once, each problem naming keys, numbers and the fix;
returns the derived per-device sizes."""

from __future__ import annotations

import dataclasses
import math
import sys

from hybridflow.config.batch_checks import check_batch_sizes
from hybridflow.config.loading import _suggest
from hybridflow.config.model_facts import (
    image_key,
    model_context_length,
    model_has_experts,
    model_paths,
    model_reads_images,
    trained_model,
)
from hybridflow.config.placement_checks import Placement, check_devices, check_placement
from hybridflow.config.precision_checks import precision_problems
from hybridflow.config.reward_checks import reward_part_problems
from hybridflow.config.sections import GROUP_ESTIMATORS, Config, ConfigError, Derived
from hybridflow.config.sft_checks import sft_problems
from hybridflow.config.speculative_checks import speculative_problems
from hybridflow.engine.options import MAX_TEMPERATURE, MIN_TEMPERATURE
from hybridflow.model_config_values import directory_config_problems

LOGGER_NAMES = ("console", "jsonl", "tensorboard", "wandb")
"""trainer.loggers choices (trainer/observe/loggers.py implements them)."""

MAX_GPU_MEMORY_GIB = 2**20
"""The largest trainer.gpu_memory_gib taken (1 PiB, far past any GPU): the plan works in
whole bytes, and inf or 1e300 GiB is no number of bytes (NaN fails every comparison too)."""


BUILTIN_NAMES = (
    frozenset({"gae", "remax", "reinforce_plus_plus", *GROUP_ESTIMATORS}),
    frozenset({"vanilla", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean"}),
    frozenset({"token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
               "seq-mean-token-sum-norm"}),
    frozenset({kind + plus for kind in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
               for plus in ("", "+")}),
)  # fmt: skip
"""The estimator, policy-loss, aggregation and KL names hybridflow.algos registers itself,
without importing it (and torch with it): ``hybridflow config show`` and ``validate`` run
in a fraction of a second. tests/config/test_validation_names.py keeps them equal."""


def _known_names() -> tuple[set[str], set[str], set[str], set[str]]:
    """Registered estimator, policy-loss, aggregation and KL names (user registrations too).
    A module that registers its own imports hybridflow.algos, before the config is validated
    (docs/algorithms.md); until one has, only the built-ins are registered."""
    algos = sys.modules.get("hybridflow.algos")
    kinds = ("ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "LOSS_AGG_MODES", "KL_KINDS")
    registries = [getattr(algos, kind, None) for kind in kinds]
    if None in registries:  # not imported (or half imported): the built-ins
        adv, pl, agg, kl = BUILTIN_NAMES
        return set(adv), set(pl), set(agg), set(kl)
    adv, pl, agg, kl = (
        set(registry.names()) if hasattr(registry, "names") else set(registry)
        for registry in registries
    )
    return adv, pl, agg, kl


def validate(cfg: Config, *, gpus_available: int | None = None, planning: bool = False) -> Derived:
    """Check every rule at once; return the derived per-device sizes or raise ConfigError.
    ``planning``: for ``hybridflow config plan``, which prices layouts and model shapes that
    cannot run yet, so it does not refuse those."""
    problems: list[str] = []
    add = problems.append
    world = check_devices(cfg, gpus_available, add)
    _check_run_modes(cfg, world, add)
    placement = check_placement(cfg, world, add, planning)
    sizes = check_batch_sizes(cfg, placement, add)
    _check_names(cfg, add)
    _check_sampling(cfg, add)
    _check_training(cfg, placement, add)
    # the models' config.json values, before anything is built from them
    for key, path in model_paths(cfg, placement.use_reference, placement.use_critic):
        problems += [f"{key}: {problem}" for problem in directory_config_problems(path)]
    _check_context(cfg, sizes.max_len, add)
    if problems:
        raise ConfigError(problems)
    d = cfg.data
    return Derived(
        world_size=world,
        train_dp_size=placement.ranks["actor"],
        rollout_dp_size=placement.ranks["rollout"],
        samples_per_step=sizes.samples,
        mini_batches_per_step=d.train_batch_size // max(sizes.mini, 1),
        mini_batch_samples_per_gpu=sizes.mini_per_gpu,
        micro_batches_per_mini_batch=sizes.micro_per_mini,
        critic_mini_batch_samples_per_gpu=sizes.critic_mini_per_gpu,
        use_reference=placement.use_reference,
        use_critic=placement.use_critic,
        max_sequence_length=sizes.max_len,
        layouts=placement.layouts,
    )


def _check_run_modes(cfg: Config, world: int, add) -> None:
    """trainer.loggers, the sync or async mode and what belongs to it, in-place LoRA."""
    t = cfg.trainer
    unknown_loggers = [name for name in t.loggers if name not in LOGGER_NAMES]
    if unknown_loggers:
        add(
            f"trainer.loggers has unknown {unknown_loggers}"
            f"{_suggest(unknown_loggers[0], list(LOGGER_NAMES))}"
        )
    if t.mode not in ("sync", "async"):
        add(f"trainer.mode = {t.mode!r} is unknown: use sync or async")
    if not isinstance(t.max_staleness, int) or t.max_staleness < 0:
        add(f"trainer.max_staleness = {t.max_staleness!r} must be an integer >= 0")
    _check_partial_rollout(cfg, add)
    _check_lora_in_place(cfg, world, add)
    _check_release_weights(cfg, add)


def _check_names(cfg: Config, add) -> None:
    """Registered estimator, loss, aggregation and KL names; the schedulers, the reward
    manager and its sandbox, a custom reward function, the reward's parts."""
    a, c, alg = cfg.actor, cfg.critic, cfg.algorithm
    adv_names, loss_names, agg_names, kl_names = _known_names()
    for key, value, known in (
        ("algorithm.adv_estimator", alg.adv_estimator, adv_names),
        ("actor.policy_loss", a.policy_loss, loss_names),
        ("actor.loss_agg_mode", a.loss_agg_mode, agg_names),
        ("critic.loss_agg_mode", c.loss_agg_mode, agg_names),
        ("actor.kl_loss_type", a.kl_loss_type, kl_names),
        ("algorithm.kl_penalty", alg.kl_penalty, kl_names),
    ):
        if value not in known:
            add(f"{key} = {value!r} is unknown{_suggest(value, sorted(known))}")
    if a.lr_scheduler not in ("constant", "linear", "cosine"):
        add(f"actor.lr_scheduler = {a.lr_scheduler!r} is unknown: use constant, linear or cosine")
    if alg.kl_ctrl_type not in ("fixed", "adaptive"):
        add(f"algorithm.kl_ctrl_type = {alg.kl_ctrl_type!r} is unknown: use fixed or adaptive")
    if cfg.reward.manager not in ("naive", "batch", "dapo"):
        add(f"reward.manager = {cfg.reward.manager!r} is unknown: use naive, batch or dapo")
    if cfg.reward.sandbox_isolation not in ("auto", "strict", "basic"):
        add(f"reward.sandbox_isolation = {cfg.reward.sandbox_isolation!r} is unknown: use auto, "
            f"strict or basic")  # fmt: skip
    if cfg.reward.max_failed_steps < 1:
        add(f"reward.max_failed_steps = {cfg.reward.max_failed_steps} must be >= 1")
    if cfg.reward.custom_fn is not None and ":" not in cfg.reward.custom_fn:
        add(
            f"reward.custom_fn = {cfg.reward.custom_fn!r} must look like path/to/file.py:function_name"
        )
    for problem in reward_part_problems(cfg):
        add(problem)


def _check_sampling(cfg: Config, add) -> None:
    """The rollout's sampling, memory share, engine options and dtype, its agent section."""
    r, t = cfg.rollout, cfg.trainer
    if r.temperature <= 0:
        add(
            f"rollout.temperature = {r.temperature}: training rollouts must sample (greedy "
            f"decoding gives the rollout.n samples of a prompt the same answer, so there is "
            f"nothing to compare): set rollout.temperature > 0 (1.0 is standard); "
            f"rollout.val_temperature=0 makes validation greedy"
        )
    if r.val_temperature < 0:
        add(f"rollout.val_temperature = {r.val_temperature} must be >= 0 (0 = greedy)")
    for key in ("temperature", "val_temperature"):  # what the sampler takes (SamplingParams)
        value = getattr(r, key)
        if value > 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
            add(f"rollout.{key} = {value} must be within [{MIN_TEMPERATURE:g}, "
                f"{MAX_TEMPERATURE:g}] (1.0 is standard)")  # fmt: skip
    if not 0 < r.top_p <= 1:
        add(f"rollout.top_p = {r.top_p} must be in (0, 1]")
    if not 0 <= r.min_p < 1:
        add(f"rollout.min_p = {r.min_p} must be in [0, 1)")
    if r.top_k == 0 or r.top_k < -1:
        add(f"rollout.top_k = {r.top_k} must be -1 (off) or >= 1")
    share = r.gpu_memory_utilization
    if share != "auto" and (isinstance(share, str) or not 0 < share <= 0.95):
        add(f"rollout.gpu_memory_utilization = {share} must be auto or a number in (0, 0.95]")
    for problem in r.engine.validate():
        add(f"rollout.engine.{problem}")
    if r.dtype not in ("model", "fp8"):
        add(f"rollout.dtype = {r.dtype!r} must be model or fp8")
    elif r.dtype == "fp8" and t.device == "cpu":
        add("rollout.dtype = fp8 needs a GPU with fp8 tensor cores; trainer.device=cpu")
    elif r.dtype == "fp8" and r.engine.weight_format != "fp8":
        for problem in dataclasses.replace(r.engine, weight_format="fp8").validate():
            add(f"rollout.dtype = fp8: rollout.engine.{problem}")
    for problem in r.agent.validate():
        add(f"rollout.agent.{problem}")


def _check_training(cfg: Config, placement: Placement, add) -> None:
    """The trainer's profile, memory and progress; learning rates and clipping; what the
    model's kind asks (routers, images, recurrent layers); precision, warm start, dynamic
    sampling, offload; the model section; how long the run is and what it keeps."""
    a, t, alg = cfg.actor, cfg.trainer, cfg.algorithm
    c, use_critic, train_dp = cfg.critic, placement.use_critic, placement.ranks["actor"]
    for problem in t.profile.validate(t.total_steps):
        add(f"trainer.profile.{problem}")
    if t.gpu_memory_gib is not None and not 0 < t.gpu_memory_gib <= MAX_GPU_MEMORY_GIB:
        add(f"trainer.gpu_memory_gib = {t.gpu_memory_gib} must be a number of GiB of one GPU, "
            f"> 0 and at most {MAX_GPU_MEMORY_GIB} (e.g. 80), or null for the visible GPU's")  # fmt: skip
    if t.progress_interval_s <= 0:
        add(f"trainer.progress_interval_s = {t.progress_interval_s} must be > 0 (seconds)")
    for key, lr, used in (("actor.lr", a.lr, True), ("critic.lr", c.lr, use_critic)):
        if used and not (lr > 0 and math.isfinite(lr)):
            add(f"{key} = {lr} must be a positive number (the tiny demo uses 2e-4, LLMs ~1e-6)")
    if a.clip_ratio_c <= 1:
        add(f"actor.clip_ratio_c = {a.clip_ratio_c} must be > 1 (dual clip; 3.0 is standard)")
    _check_router(cfg, add)
    _check_images(cfg, add)
    for problem in speculative_problems(cfg):
        add(problem)
    for problem in precision_problems(cfg, use_critic=use_critic):
        add(problem)
    if cfg.model.path.startswith("sft:"):  # the warm start trains with the sft section
        for problem in sft_problems(cfg.sft):
            add(problem)
    if alg.dynamic_sampling and alg.adv_estimator not in GROUP_ESTIMATORS:
        add(
            f"algorithm.dynamic_sampling filters groups but algorithm.adv_estimator = {alg.adv_estimator} "
            f"is not a group estimator ({', '.join(GROUP_ESTIMATORS)})"
        )
    if alg.dynamic_sampling and alg.max_gen_rounds < 1:
        add(f"algorithm.max_gen_rounds = {alg.max_gen_rounds} must be >= 1")
    if a.optimizer_offload and train_dp > 1:
        add(f"actor.optimizer_offload = true steps AdamW on the host of one training GPU, but the "
            f"actor trains on {train_dp} ranks (FSDP2): set actor.optimizer_offload=false and "
            "actor.param_offload=true (FSDP2 keeps each rank's masters and AdamW state on the "
            "host and steps there), or train on one GPU")  # fmt: skip
    if cfg.model.lora_rank < 0:
        add(f"model.lora_rank = {cfg.model.lora_rank} must be >= 0")
    if not 0 <= cfg.model.lora_dropout < 1:
        add(f"model.lora_dropout = {cfg.model.lora_dropout} must be in [0, 1) (the share of "
            "the adapters' inputs dropped in training)")  # fmt: skip
    if cfg.model.gradient_checkpointing not in (True, False, "auto"):
        add(
            f"model.gradient_checkpointing = {cfg.model.gradient_checkpointing!r} is unknown: "
            "use true, false or auto (on only when the memory plan needs it)"
        )
    if cfg.model.compile not in (True, False, "auto"):
        add(
            f"model.compile = {cfg.model.compile!r} is unknown: use true, false or auto (on "
            "when training on CUDA)"
        )
    if cfg.model.dtype not in ("auto", "bfloat16", "float32", "float16"):
        add(f"model.dtype = {cfg.model.dtype!r} is unknown: use auto, bfloat16 or float32")
    if t.keep_last_k is not None and t.keep_last_k < 1:
        add(f"trainer.keep_last_k = {t.keep_last_k} must be >= 1 (or null: keep all)")
    if t.total_steps < 0:
        add(f"trainer.total_steps = {t.total_steps} must be >= 0")
    if t.total_epochs is not None and t.total_epochs < 1:
        add(f"trainer.total_epochs = {t.total_epochs} must be >= 1 (or null: trainer.total_steps)")


def _check_context(cfg: Config, max_len: int, add) -> None:
    """The longest sequence against the context of model.path."""
    d = cfg.data
    ctx = model_context_length(cfg.model.path)
    if ctx is not None and max_len > ctx:
        add(
            f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + "
            f"{d.max_response_length} = {max_len} exceeds the context of model.path = {cfg.model.path!r} "
            f"({ctx} tokens): shorten one of them"
        )


def _check_images(cfg: Config, add) -> None:
    """data.image_key: a vision-language model's (a text-only model has no vision encoder);
    what prompts with images do not run through yet is refused up front (agent programs,
    and experts spread over several rollout replicas)."""
    key = cfg.data.image_key
    if key is not None and (not isinstance(key, str) or not key):
        add(f"data.image_key = {key!r} must be the name of the rows' image column (verl's: "
            "images)")  # fmt: skip
    elif key is not None and model_reads_images(trained_model(cfg)) is False:
        add(f"data.image_key = {key!r} asks for prompts with images, but model.path = "
            f"{cfg.model.path!r} is a text-only model (no vision encoder hybridflow runs): use "
            "a Qwen2.5-VL model (e.g. the tiny-vl preset), or drop data.image_key")  # fmt: skip
    if image_key(cfg) is None:
        _check_image_tasks_need_images(cfg, add)
        return
    # what prompts with images do not run through yet (docs/engine.md, Prompts with images)
    unsupported = {
        # the built-in tool loop runs them (agents/images.py); an agent program talks to the
        # OpenAI endpoint in text, which refuses images in an episode's request
        "rollout.agent.loop": cfg.rollout.agent.loop == "openai",
        # experts over replicas: the rollout's rows travel without their images (rollout_tp)
        "rollout.expert_parallel_size": (cfg.rollout.expert_parallel_size or 1)
        > cfg.rollout.tensor_parallel_size,
    }  # fmt: skip
    for name, on in unsupported.items():
        if on:
            add(f"{name} = {_value(cfg, name)!r} does not run prompts with images yet (a "
                "vision-language model reads data.image_key): leave it at its default")  # fmt: skip


def _check_image_tasks_need_images(cfg: Config, add) -> None:
    """A built-in task of pictures given to a text-only model would train on its questions
    without the pictures they ask about."""
    from hybridflow.data.builtin import BUILTIN_PREFIX, IMAGE_TASKS

    for key in ("data.train_files", "data.val_files"):
        for entry in _value(cfg, key) or ():
            task = entry[len(BUILTIN_PREFIX) :] if str(entry).startswith(BUILTIN_PREFIX) else None
            if task in IMAGE_TASKS:
                add(f"{key} has {entry}, whose prompts are pictures, but model.path = "
                    f"{cfg.model.path!r} is a text-only model: use a vision-language model "
                    "(model.path=sft:shapes, the tiny-vl warm start, as examples/vision.yaml "
                    "does), or a text task")  # fmt: skip


def _value(cfg: Config, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _check_router(cfg: Config, add) -> None:
    """actor.router_replay and the router losses (mixture-of-experts models)."""
    a = cfg.actor
    if a.router_replay not in ("off", "rollout"):
        add(f"actor.router_replay = {a.router_replay!r} is unknown: use off or rollout (replay "
            "the experts the rollout chose)")  # fmt: skip
    elif a.router_replay == "rollout" and not cfg.rollout.engine.record_routes:
        add("actor.router_replay = rollout replays the routes the engine records, but "
            "rollout.engine.record_routes = false: set it to true")  # fmt: skip
    elif a.router_replay == "rollout" and cfg.rollout.agent.loop is not None:
        add(f"actor.router_replay = rollout is not recorded for rollout.agent.loop = "
            f"{cfg.rollout.agent.loop!r} episodes: set actor.router_replay=off")  # fmt: skip
    for key in ("router_aux_loss_coef", "router_z_loss_coef"):
        value = getattr(a, key)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            add(f"actor.{key} = {value} must be a number >= 0 (0: off)")


def _check_partial_rollout(cfg: Config, add) -> None:
    """trainer.partial_rollout and trainer.stale_policy belong to the async mode."""
    t = cfg.trainer
    if t.stale_policy not in ("wait", "drop"):
        add(f"trainer.stale_policy = {t.stale_policy!r} is unknown: use wait or drop")
    if not isinstance(t.partial_rollout, bool):
        add(f"trainer.partial_rollout = {t.partial_rollout!r} must be true or false")
    elif t.partial_rollout and t.mode != "async":
        add(f"trainer.partial_rollout = true needs trainer.mode = async (it is {t.mode!r}): "
            "set trainer.mode=async, or trainer.partial_rollout=false")  # fmt: skip
    elif t.partial_rollout and cfg.rollout.agent.loop is not None:
        add(f"trainer.partial_rollout = true does not run with rollout.agent.loop = "
            f"{cfg.rollout.agent.loop!r} (episodes drive the engine themselves): set "
            "trainer.partial_rollout=false")  # fmt: skip
    if t.stale_policy == "drop" and not (t.mode == "async" and t.partial_rollout is True):
        add("trainer.stale_policy = drop needs trainer.mode=async and trainer.partial_rollout="
            "true (without partial rollouts a batch is generated by exactly the version its "
            "schedule names, nothing exceeds the bound): set trainer.stale_policy=wait")  # fmt: skip


def _check_lora_in_place(cfg: Config, world: int, add) -> None:
    """rollout.lora_in_place reads the actor's own tensors: one device, nothing to copy."""
    if not cfg.rollout.lora_in_place:
        return
    m, t = cfg.model, cfg.trainer
    needs = [
        ("model.lora_rank > 0 (there are no adapters to decode)", m.lora_rank > 0),
        ("one device (trainer.nnodes × trainer.n_gpus_per_node = 1)", world == 1),
        ("trainer.placement = colocate", t.placement == "colocate"),
        ("the base weights in the rollout's dtype: model.dtype = bfloat16 (auto keeps fp32 "
         "masters on a GPU)", m.dtype != "auto" or t.device == "cpu"),
        ("no generation over an update: trainer.mode = sync, or async with "
         "trainer.max_staleness = 0 and no partial rollouts",
         t.mode != "async" or (t.max_staleness == 0 and not t.partial_rollout)),
        ("a dense model (a mixture of experts' expert adapters are merged for the rollout)",
         model_has_experts(m.path) is not True),
    ]  # fmt: skip
    for what, ok in needs:
        if not ok:
            add(f"rollout.lora_in_place = true needs {what}: change that, or set "
                "rollout.lora_in_place=false (a merged copy)")  # fmt: skip


def _check_release_weights(cfg: Config, add) -> None:
    """rollout.release_weights frees the engine's copy between a step's generation and its
    weight sync: nothing may generate in between, and the update must share the GPU."""
    t = cfg.trainer
    if not cfg.rollout.release_weights:
        return
    if t.mode != "sync":
        add("rollout.release_weights = true needs trainer.mode = sync (in async mode the "
            "rollout generates the next batches while the actor updates): set "
            "rollout.release_weights=false")  # fmt: skip
    if t.placement != "colocate":
        add("rollout.release_weights = true frees the rollout's weights for the update on the "
            "same GPUs; with trainer.placement = split no update shares them: set "
            "rollout.release_weights=false")  # fmt: skip
