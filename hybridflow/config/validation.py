"""``validate(cfg)``: every rule checked at once, each problem naming keys, numbers and the fix;
returns the derived per-device sizes."""

from __future__ import annotations

import dataclasses
import math

from hybridflow.config.loading import _suggest
from hybridflow.config.model_facts import (
    image_key,
    model_context_length,
    model_has_experts,
    model_has_recurrent_layers,
    model_paths,
    model_reads_images,
    trained_model,
)
from hybridflow.config.parallel_checks import check_layouts, roles_in_use
from hybridflow.config.precision_checks import precision_problems
from hybridflow.config.reward_checks import reward_part_problems
from hybridflow.config.sections import GROUP_ESTIMATORS, Config, ConfigError, Derived
from hybridflow.config.sft_checks import sft_problems
from hybridflow.model_config_values import directory_config_problems
from hybridflow.parallel.roles import RoleLayouts, sizes_of

LOGGER_NAMES = ("console", "jsonl", "tensorboard", "wandb")
"""trainer.loggers choices (trainer/observe/loggers.py implements them)."""

MAX_GPU_MEMORY_GIB = 2**20
"""The largest trainer.gpu_memory_gib taken (1 PiB, far past any GPU): the plan works in
whole bytes, and inf or 1e300 GiB is no number of bytes (NaN fails every comparison too)."""


def _known_names() -> tuple[set[str], set[str], set[str], set[str]]:
    """Registered estimator, policy-loss, aggregation and KL names (user registrations too)."""
    try:
        from hybridflow import algos

        def names(registry) -> set[str]:
            return set(registry.names()) if hasattr(registry, "names") else set(registry)

        return (
            names(algos.ADVANTAGE_ESTIMATORS),
            names(algos.POLICY_LOSSES),
            names(algos.LOSS_AGG_MODES),
            names(algos.KL_KINDS),
        )
    except (ImportError, AttributeError):  # algos not importable: fall back to the built-ins
        adv = {"gae", "remax", "reinforce_plus_plus", *GROUP_ESTIMATORS}
        pl = {"vanilla", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean"}
        agg = {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
        kl = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+"}
        return adv, pl, agg, kl


def validate(cfg: Config, *, gpus_available: int | None = None, planning: bool = False) -> Derived:
    """Check every rule at once; return the derived per-device sizes or raise ConfigError.
    ``planning``: for ``hybridflow config plan``, which prices layouts and model shapes that
    cannot run yet, so it does not refuse those."""
    d, a, r, c, t, alg = cfg.data, cfg.actor, cfg.rollout, cfg.critic, cfg.trainer, cfg.algorithm
    problems: list[str] = []
    add = problems.append

    # ---- devices and placement
    world = t.nnodes * t.n_gpus_per_node
    if t.nnodes < 1 or t.n_gpus_per_node < 1:
        add(
            f"trainer.nnodes = {t.nnodes} and trainer.n_gpus_per_node = {t.n_gpus_per_node} must both be >= 1"
        )
        world = max(world, 1)
    if t.backend not in ("inprocess", "local", "ray"):
        add(f"trainer.backend = {t.backend!r} is unknown: use inprocess, local or ray")
    if t.backend == "inprocess" and world != 1:
        add(
            f"trainer.backend = inprocess runs on one device but trainer.nnodes × trainer.n_gpus_per_node "
            f"= {t.nnodes} × {t.n_gpus_per_node} = {world}: set trainer.backend=local (one node) or ray"
        )
    if t.backend == "local" and t.nnodes != 1:
        add(
            f"trainer.backend = local runs on one node but trainer.nnodes = {t.nnodes}: use trainer.backend=ray"
        )
    if gpus_available is not None and t.device != "cpu" and t.n_gpus_per_node > gpus_available > 0:
        add(
            f"trainer.n_gpus_per_node = {t.n_gpus_per_node} but this node has {gpus_available} GPU(s): "
            f"set trainer.n_gpus_per_node <= {gpus_available}"
        )
    reward_pool = cfg.reward.model.n_gpus_per_node
    if (gpus_available is not None and t.device != "cpu" and isinstance(reward_pool, int)
            and reward_pool > 0 and t.n_gpus_per_node <= gpus_available
            and t.n_gpus_per_node + reward_pool > gpus_available > 0):  # fmt: skip
        add(
            f"trainer.n_gpus_per_node + reward.model.n_gpus_per_node = {t.n_gpus_per_node} + "
            f"{reward_pool} GPUs, but this node has {gpus_available}: give the reward model "
            f"fewer devices of its own, or share the training ones (reward.model.n_gpus_per_node=0)"
        )
    if t.device not in ("auto", "cpu", "cuda"):
        add(f"trainer.device = {t.device!r} is unknown: use auto, cpu or cuda")
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
    if t.placement not in ("colocate", "split"):
        add(f"trainer.placement = {t.placement!r} is unknown: use colocate or split")
    train_dp, rollout_dp = world, world
    if t.placement == "split" and t.nnodes > 1:
        add("trainer.placement = split runs on one node: set trainer.nnodes=1")
    if t.placement == "split":
        if not 0 < t.rollout_gpus < world:
            add(
                f"trainer.placement = split needs 0 < trainer.rollout_gpus < {world} (all devices), "
                f"got trainer.rollout_gpus = {t.rollout_gpus}: give the rollout some devices and "
                f"leave the rest for training"
            )
        else:
            train_dp, rollout_dp = world - t.rollout_gpus, t.rollout_gpus
    use_reference, use_critic = a.use_kl_loss or alg.use_kl_in_reward, alg.adv_estimator == "gae"
    layouts = check_layouts(cfg, _worlds(cfg, train_dp, rollout_dp),
                            roles_in_use(use_reference, use_critic), add, planning)  # fmt: skip
    train_world = train_dp
    ranks = _data_ranks(layouts, train_dp, rollout_dp)
    train_dp, rollout_dp = ranks["actor"], ranks["rollout"]

    # ---- batch sizes
    n = r.n
    if n < 1:
        add(f"rollout.n = {n} must be >= 1")
        n = 1
    if r.max_num_seqs < 1:  # the engine's slots: none would hold a sequence
        add(f"rollout.max_num_seqs = {r.max_num_seqs} must be >= 1 (sequences decoded at once)")
    if alg.adv_estimator in GROUP_ESTIMATORS and r.n == 1:  # below 1 is said just above
        add(
            f"algorithm.adv_estimator = {alg.adv_estimator} normalises within groups of rollout.n samples "
            f"but rollout.n = {r.n}: set rollout.n >= 2 (e.g. 8)"
        )
    if d.train_batch_size < 1:
        add(f"data.train_batch_size = {d.train_batch_size} must be >= 1")
    samples = d.train_batch_size * n
    splits = [(train_dp, "data-parallel ranks")]
    if rollout_dp != train_dp:
        splits.append((rollout_dp, "rollout engines"))
    for role, used in (("ref", use_reference), ("critic", use_critic)):
        if used and ranks[role] not in (train_dp, rollout_dp):
            splits.append((ranks[role], f"{role} data-parallel ranks"))
    for dp, what in splits:
        if dp > 0 and samples % dp:
            need = dp // math.gcd(n, dp)
            add(
                f"data.train_batch_size × rollout.n = {d.train_batch_size} × {n} = {samples} samples cannot be "
                f"split over {dp} {what}: make data.train_batch_size a multiple of {need}"
            )
    mini = a.ppo_mini_batch_size
    mini_per_gpu = 0
    if mini < 1 or mini > d.train_batch_size:
        add(
            f"actor.ppo_mini_batch_size = {mini} must be between 1 and data.train_batch_size = "
            f"{d.train_batch_size}"
        )
    else:
        if d.train_batch_size % mini:
            add(
                f"data.train_batch_size = {d.train_batch_size} is not a multiple of actor.ppo_mini_batch_size "
                f"= {mini}: the last mini-batch would be partial; pick a divisor of {d.train_batch_size}"
            )
        if (mini * n) % train_dp:
            need = train_dp // math.gcd(n, train_dp)
            add(
                f"actor.ppo_mini_batch_size × rollout.n = {mini} × {n} = {mini * n} samples cannot be split "
                f"over {train_dp} data-parallel ranks{_dp_arithmetic(cfg, 'actor', train_world)}: "
                f"make actor.ppo_mini_batch_size a multiple of {need}"
            )
        mini_per_gpu = mini * n // max(train_dp, 1)
    micro_per_mini = None
    if a.max_tokens_per_gpu is None:
        mb = a.micro_batch_size_per_gpu
        if mb < 1:
            add(
                f"actor.micro_batch_size_per_gpu = {mb} must be >= 1 (or set actor.max_tokens_per_gpu)"
            )
        elif mini_per_gpu and mini_per_gpu % mb:
            add(
                f"actor mini-batch per GPU = actor.ppo_mini_batch_size × rollout.n / data-parallel ranks = {mini} × {n} / "
                f"{train_dp} = {mini_per_gpu} samples is not a multiple of actor.micro_batch_size_per_gpu = "
                f"{mb}: pick a divisor of {mini_per_gpu}"
            )
        elif mini_per_gpu:
            micro_per_mini = mini_per_gpu // mb
    max_len = d.max_prompt_length + d.max_response_length
    if isinstance(a.max_tokens_per_gpu, str) and a.max_tokens_per_gpu != "auto":
        add(f"actor.max_tokens_per_gpu = {a.max_tokens_per_gpu!r} is unknown: use a number of "
            f"tokens (at least {max_len}), auto (the memory plan picks it) or null (batches of "
            f"actor.micro_batch_size_per_gpu samples)")  # fmt: skip
    actor_budget = a.max_tokens_per_gpu if isinstance(a.max_tokens_per_gpu, int) else None
    for key, budget in (
        ("actor.max_tokens_per_gpu", actor_budget),
        ("actor.log_prob_max_tokens_per_gpu", a.log_prob_max_tokens_per_gpu),
        ("ref.max_tokens_per_gpu", cfg.ref.max_tokens_per_gpu),
        ("critic.max_tokens_per_gpu", c.max_tokens_per_gpu),
    ):
        if budget is not None and budget < max_len:
            add(
                f"{key} = {budget} is smaller than one full sequence, data.max_prompt_length + "
                f"data.max_response_length = {d.max_prompt_length} + {d.max_response_length} = {max_len}: "
                f"raise it to at least {max_len} (2-4× that packs better)"
            )
    if a.ppo_epochs < 1:
        add(f"actor.ppo_epochs = {a.ppo_epochs} must be >= 1")
    if d.max_prompt_length < 1 or d.max_response_length < 1:
        add(
            f"data.max_prompt_length = {d.max_prompt_length} and data.max_response_length = "
            f"{d.max_response_length} must both be >= 1"
        )
    if d.overlong_prompts not in ("filter", "error", "truncate"):
        add(
            f"data.overlong_prompts = {d.overlong_prompts!r} is unknown: use filter, error or truncate"
        )

    # ---- critic (GAE)
    critic_mini_per_gpu = 0
    if use_critic:
        cmini, critic_dp = c.ppo_mini_batch_size or mini, ranks["critic"]
        if cmini < 1 or d.train_batch_size % cmini or (cmini * n) % critic_dp:
            add(
                f"critic.ppo_mini_batch_size = {cmini} must divide data.train_batch_size = {d.train_batch_size} "
                f"and × rollout.n = {n} split evenly over {critic_dp} data-parallel ranks"
                f"{_dp_arithmetic(cfg, 'critic', train_world)}"
            )
        else:
            critic_mini_per_gpu = cmini * n // critic_dp
            if c.max_tokens_per_gpu is None and critic_mini_per_gpu % max(
                c.micro_batch_size_per_gpu, 1
            ):
                add(
                    f"critic mini-batch per GPU = {critic_mini_per_gpu} samples is not a multiple of "
                    f"critic.micro_batch_size_per_gpu = {c.micro_batch_size_per_gpu}"
                )
        if c.ppo_epochs is not None and c.ppo_epochs < 1:
            add(f"critic.ppo_epochs = {c.ppo_epochs} must be >= 1")

    # ---- names
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
    problems += reward_part_problems(cfg)

    # ---- sampling and algorithm knobs
    if r.temperature <= 0:
        add(
            f"rollout.temperature = {r.temperature}: training rollouts must sample (greedy "
            f"decoding gives the rollout.n samples of a prompt the same answer, so there is "
            f"nothing to compare): set rollout.temperature > 0 (1.0 is standard); "
            f"rollout.val_temperature=0 makes validation greedy"
        )
    if r.val_temperature < 0:
        add(f"rollout.val_temperature = {r.val_temperature} must be >= 0 (0 = greedy)")
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
    speculative = cfg.rollout.engine.speculative
    if speculative != "off" and model_has_recurrent_layers(trained_model(cfg)):
        add(f"rollout.engine.speculative = {speculative!r}: the model "
            f"{trained_model(cfg)!r} has recurrent layers (Gated DeltaNet), whose state cannot "
            "be rolled back past rejected drafts: set rollout.engine.speculative=off")  # fmt: skip
    problems += precision_problems(cfg, use_critic=use_critic)
    if cfg.model.path.startswith("sft:"):  # the warm start trains with the sft section
        problems += sft_problems(cfg.sft)
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

    # ---- the models' config.json values, before anything is built from them
    for key, path in model_paths(cfg, use_reference, use_critic):
        problems += [f"{key}: {problem}" for problem in directory_config_problems(path)]

    # ---- lengths vs the model's context
    ctx = model_context_length(cfg.model.path)
    if ctx is not None and max_len > ctx:
        add(
            f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + "
            f"{d.max_response_length} = {max_len} exceeds the context of model.path = {cfg.model.path!r} "
            f"({ctx} tokens): shorten one of them"
        )

    if problems:
        raise ConfigError(problems)
    return Derived(
        world_size=world,
        train_dp_size=train_dp,
        rollout_dp_size=rollout_dp,
        samples_per_step=samples,
        mini_batches_per_step=d.train_batch_size // max(mini, 1),
        mini_batch_samples_per_gpu=mini_per_gpu,
        micro_batches_per_mini_batch=micro_per_mini,
        critic_mini_batch_samples_per_gpu=critic_mini_per_gpu,
        use_reference=use_reference,
        use_critic=use_critic,
        max_sequence_length=max_len,
        layouts=layouts,
    )


def _worlds(cfg: Config, train_world: int, rollout_world: int) -> dict[str, tuple[int, str]]:
    """The devices of the training roles and of the rollout, and the keys that set them."""
    t = cfg.trainer
    devices = (
        "trainer.n_gpus_per_node" if t.nnodes == 1 else "trainer.nnodes × trainer.n_gpus_per_node"
    )
    if t.placement == "split":
        return {"train": (train_world, f"{devices} − trainer.rollout_gpus"),
                "rollout": (rollout_world, "trainer.rollout_gpus")}  # fmt: skip
    return {"train": (train_world, devices), "rollout": (rollout_world, devices)}


def _data_ranks(layouts: RoleLayouts | None, train_world: int, rollout_world: int) -> dict:
    """Ranks that see different data, per role: devices / (tp × sp) (verl's normalisation);
    the devices themselves while a layout does not tile (that problem is reported)."""
    if layouts is None:
        return {"actor": train_world, "ref": train_world, "critic": train_world,
                "rollout": rollout_world}  # fmt: skip
    return {role: getattr(layouts, role).dp for role in ("actor", "ref", "critic", "rollout")}


def _dp_arithmetic(cfg: Config, role: str, world: int) -> str:
    """`` (devices / (tp × sp) = …)`` when the role's layout is more than data parallel."""
    sizes = sizes_of(cfg, role)
    if sizes["tp"] * sizes["sp"] == 1:
        return ""
    return (f" (its {world} devices / ({role}.tensor_parallel_size × {role}.sequence_parallel_size "
            f"= {sizes['tp']} × {sizes['sp']}))")  # fmt: skip


def _check_images(cfg: Config, add) -> None:
    """data.image_key: a vision-language model's (a text-only model has no vision encoder);
    what prompts with images do not run through yet is refused up front (the rollout
    service, agent programs, mixed prefill steps, and the sharded layouts no test has run)."""
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
        "trainer.partial_rollout": cfg.trainer.partial_rollout,
        # the built-in tool loop runs them (agents/images.py); an agent program talks to the
        # OpenAI endpoint in text, which refuses images in an episode's request
        "rollout.agent.loop": cfg.rollout.agent.loop == "openai",
        "rollout.engine.max_prefill_tokens_per_step": cfg.rollout.engine.max_prefill_tokens_per_step > 0,
        "actor.sequence_parallel_size": cfg.actor.sequence_parallel_size > 1,
        "rollout.tensor_parallel_size": cfg.rollout.tensor_parallel_size > 1,
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
