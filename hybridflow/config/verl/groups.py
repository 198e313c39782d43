"""verl keys that are read together, with verl's defaults for the ones not given.

Each rule gets the group's keys that were given (name -> value) and the :class:`Context`,
and returns rows of our keys, notices and problems. The batch sizes follow verl's documented
semantics: ``ppo_mini_batch_size`` counts prompts (× rollout.n samples, split over the
ranks), ``*_per_gpu`` sizes count samples on one GPU, the deprecated global micro sizes are
divided by the number of devices, and ``use_dynamic_bsz`` replaces the micro-batch size by
the token budget ``*_max_token_len_per_gpu``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.config.verl.converters import as_bool, as_number
from hybridflow.config.verl.rules import Context, GroupResult, Notice, Row
from hybridflow.config.verl.table_parts import ACTOR, REF, ROLLOUT

ACTOR_TOKENS_DEFAULT = 16384  # verl: actor.ppo_max_token_len_per_gpu
CRITIC_TOKENS_DEFAULT = 32768  # verl: critic.ppo_max_token_len_per_gpu


def _inherited(given: Mapping, ctx: Context, key: str, parent: str | None, default: Any):
    """(value, the verl key it came from or None): ``key``, else verl's ``${parent}``."""
    if key in given:
        return given[key], key
    if parent is not None and parent in ctx.verl:
        return ctx.verl[parent], parent
    return default, None


def _batching(
    given: Mapping,
    ctx: Context,
    *,
    ours: str,
    per_gpu: str,
    global_: str,
    dynamic: tuple[str, str | None],
    tokens: tuple[str, str | None, int],
) -> GroupResult:
    """``ours.micro_batch_size_per_gpu`` / ``ours.max_tokens_per_gpu`` from verl's keys."""
    res = GroupResult()
    is_dynamic, dynamic_src = _inherited(given, ctx, dynamic[0], dynamic[1], False)
    budget, budget_src = _inherited(given, ctx, tokens[0], tokens[1], tokens[2])
    micro_keys = [k for k in (per_gpu, global_) if given.get(k) is not None]
    if as_bool(is_dynamic):
        src = tuple(k for k in (dynamic_src, budget_src) if k)
        res.rows.append(Row(src, f"{ours}.max_tokens_per_gpu", int(budget)))
        for key in micro_keys:
            res.notices.append(Notice(key, f"unused with dynamic batch sizes ({dynamic[0]})"))
        return res
    if dynamic_src is not None:
        res.rows.append(Row((dynamic_src,), f"{ours}.max_tokens_per_gpu", None))
    if tokens[0] in given:
        res.notices.append(Notice(tokens[0], f"used only with {dynamic[0]}=True"))
    if len(micro_keys) == 2:
        res.problems.append(f"{per_gpu} and {global_} are both set: keep only {per_gpu}")
    elif micro_keys == [per_gpu]:
        res.rows.append(Row((per_gpu,), f"{ours}.micro_batch_size_per_gpu", int(given[per_gpu])))
    elif micro_keys == [global_]:
        ranks, how = data_parallel_ranks(ctx, ours)
        total = int(given[global_])
        if total < ranks or total % ranks:
            res.problems.append(
                f"{global_} = {total} counts samples over all {ranks} data-parallel ranks{how} "
                f"and must be a multiple of {ranks}: set {per_gpu} instead"
            )
        else:
            res.rows.append(Row((global_,), f"{ours}.micro_batch_size_per_gpu", total // ranks))
    return res


# our role -> the verl prefixes whose layout keys set its sizes, its own first: as our
# ref.* and critic.* sizes do, both follow the actor's unless given (verl's critic would
# default to 1: a layout changes memory and speed, not the updates).
LAYOUT_KEYS = {"actor": (ACTOR,), "ref": (REF, ACTOR), "critic": ("critic.", ACTOR)}


def data_parallel_ranks(ctx: Context, role: str) -> tuple[int, str]:
    """verl's normalisation of a global size: devices / (Ulysses size × Megatron tensor-
    parallel size) of ``role``, and the arithmetic for a message (empty when it is plain
    data parallel)."""
    sizes = {}
    for ours_key, verl_name in (("sequence_parallel_size", "ulysses_sequence_parallel_size"),
                                ("tensor_parallel_size", "megatron.tensor_model_parallel_size")):  # fmt: skip
        given = [ctx.verl[p + verl_name] for p in LAYOUT_KEYS[role] if p + verl_name in ctx.verl]
        value = given[0] if given else ctx.ours.get(f"{role}.{ours_key}")
        try:
            sizes[ours_key] = int(as_number(value)) if value is not None else 1
        except (TypeError, ValueError):
            sizes[ours_key] = 1  # a malformed size is reported where it is loaded
    world = ctx.world_size()
    split = sizes["sequence_parallel_size"] * sizes["tensor_parallel_size"]
    if split <= 1 or world % split:
        return world, ""  # a size that does not tile the devices is reported by validate()
    return world // split, f" ({world} devices / (sequence × tensor parallel = {split}))"


def actor_batch(given: Mapping, ctx: Context) -> GroupResult:
    return _batching(
        given,
        ctx,
        ours="actor",
        per_gpu=ACTOR + "ppo_micro_batch_size_per_gpu",
        global_=ACTOR + "ppo_micro_batch_size",
        dynamic=(ACTOR + "use_dynamic_bsz", None),
        tokens=(ACTOR + "ppo_max_token_len_per_gpu", None, ACTOR_TOKENS_DEFAULT),
    )


def ref_batch(given: Mapping, ctx: Context) -> GroupResult:
    return _batching(
        given,
        ctx,
        ours="ref",
        per_gpu=REF + "log_prob_micro_batch_size_per_gpu",
        global_=REF + "log_prob_micro_batch_size",
        dynamic=(REF + "log_prob_use_dynamic_bsz", ACTOR + "use_dynamic_bsz"),
        tokens=(
            REF + "log_prob_max_token_len_per_gpu",
            ACTOR + "ppo_max_token_len_per_gpu",
            ACTOR_TOKENS_DEFAULT,
        ),
    )


def critic_batch(given: Mapping, ctx: Context) -> GroupResult:
    res = _batching(
        given,
        ctx,
        ours="critic",
        per_gpu="critic.ppo_micro_batch_size_per_gpu",
        global_="critic.ppo_micro_batch_size",
        dynamic=("critic.use_dynamic_bsz", ACTOR + "use_dynamic_bsz"),
        tokens=("critic.ppo_max_token_len_per_gpu", None, CRITIC_TOKENS_DEFAULT),
    )
    for key in (
        "critic.forward_micro_batch_size",
        "critic.forward_micro_batch_size_per_gpu",
        "critic.forward_max_token_len_per_gpu",
    ):
        if key in given:
            res.notices.append(Notice(key, "the critic's forward uses its training batch sizes"))
    return res


def _optimizer_steps_per_rl_step(ctx: Context, mini_key: str, epochs_key: str) -> int:
    """verl advances its LR schedule once per RL step, ours once per optimizer step."""
    batch = int(ctx.ours.get("data.train_batch_size", 1))
    mini = int(ctx.verl.get(mini_key, ctx.verl.get(ACTOR + "ppo_mini_batch_size", batch)))
    epochs = int(ctx.verl.get(epochs_key, ctx.verl.get(ACTOR + "ppo_epochs", 1)))
    return max(batch // max(mini, 1), 1) * max(epochs, 1)


def _warmup(given: Mapping, ctx: Context, prefix: str, ours: str, mini: str, epochs: str):
    res = GroupResult()
    steps_key, ratio_key = prefix + "lr_warmup_steps", prefix + "lr_warmup_steps_ratio"
    steps = int(given.get(steps_key, -1) or -1)
    ratio = float(as_number(given.get(ratio_key, 0.0) or 0.0))
    per_step = _optimizer_steps_per_rl_step(ctx, mini, epochs)
    if steps > 0:
        res.rows.append(Row((steps_key,), ours, steps * per_step))
        if ratio_key in given:
            res.notices.append(Notice(ratio_key, f"unused: {steps_key} is set"))
    elif ratio > 0:
        total = ctx.verl.get("trainer.total_training_steps")
        if total is None:
            res.problems.append(
                f"{ratio_key} = {ratio} needs the run length in steps: add "
                f"trainer.total_training_steps=N, or set {steps_key} instead"
            )
        else:
            src = (ratio_key, "trainer.total_training_steps")
            res.rows.append(Row(src, ours, int(ratio * int(total)) * per_step))
    elif given:
        res.rows.append(Row(tuple(given), ours, 0))
    return res


def actor_warmup(given: Mapping, ctx: Context) -> GroupResult:
    mini, epochs = ACTOR + "ppo_mini_batch_size", ACTOR + "ppo_epochs"
    return _warmup(given, ctx, ACTOR + "optim.", "actor.lr_warmup_steps", mini, epochs)


def critic_warmup_steps(given: Mapping, ctx: Context) -> GroupResult:
    mini, epochs = "critic.ppo_mini_batch_size", "critic.ppo_epochs"
    return _warmup(given, ctx, "critic.optim.", "critic.lr_warmup_steps", mini, epochs)


def clip_ratios(given: Mapping, ctx: Context) -> GroupResult:
    """verl's clip_ratio sets both sides; clip_ratio_low / clip_ratio_high, when given, win."""
    res = GroupResult()
    both_key = ACTOR + "clip_ratio"
    for side in ("low", "high"):
        key = f"{ACTOR}clip_ratio_{side}"
        src = key if given.get(key) is not None else both_key
        if given.get(src) is not None:
            value = float(as_number(given[src]))
            res.rows.append(Row((src,), f"actor.clip_ratio_{side}", value))
    return res


# Options of verl's policy losses, the loss that reads each, and verl's default.
LOSS_OPTIONS = {
    "clip_cov_ratio": ("clip_cov", 2e-4),
    "clip_cov_lb": ("clip_cov", 1.0),
    "clip_cov_ub": ("clip_cov", 5.0),
    "kl_cov_ratio": ("kl_cov", 2e-4),
    "ppo_kl_coef": ("kl_cov", 0.1),
    "tau_pos": ("sapo", 1.0),
    "tau_neg": ("sapo", 1.05),
}


def option_key(name: str) -> str:
    return ACTOR + (name if name.startswith("tau_") else f"policy_loss.{name}")


def policy_loss(given: Mapping, ctx: Context) -> GroupResult:
    res = GroupResult()
    mode_key = ACTOR + "policy_loss.loss_mode"
    mode = given.get(mode_key, "vanilla")
    if mode_key in given:
        res.rows.append(Row((mode_key,), "actor.policy_loss", mode))
    options, sources = {}, []
    for name, (owner, default) in LOSS_OPTIONS.items():
        key = option_key(name)
        if owner == mode:
            options[name] = float(as_number(given.get(key, default)))
            sources += [key] if key in given else []
        elif key in given:
            res.notices.append(Notice(key, f"used only with {mode_key}={owner}"))
    if options:
        res.rows.append(Row((mode_key, *sources), "actor.policy_loss_kwargs", options))
    return res


def overlong_prompts(given: Mapping, ctx: Context) -> GroupResult:
    res = GroupResult()
    filter_key, trunc_key = "data.filter_overlong_prompts", "data.truncation"
    src = tuple(given)
    if as_bool(given.get(filter_key, False)):
        res.rows.append(Row((filter_key,), "data.overlong_prompts", "filter"))
        if trunc_key in given:
            res.notices.append(Notice(trunc_key, "unused: overlong prompts are filtered out"))
        return res
    side = given.get(trunc_key, "error")
    if side == "error":
        res.rows.append(Row(src, "data.overlong_prompts", "error"))
    elif side == "left":
        res.rows.append(Row(src, "data.overlong_prompts", "truncate"))
    else:
        res.problems.append(
            f"{trunc_key} = {side!r}: hybridflow truncates prompts only from the left "
            f"(data.truncation=left) or filters them (data.filter_overlong_prompts=True)"
        )
    return res


def reward_function(given: Mapping, ctx: Context) -> GroupResult:
    res = GroupResult()
    path_key, name_key = "custom_reward_function.path", "custom_reward_function.name"
    path = given.get(path_key)
    if path is None:
        for key in given:
            res.notices.append(Notice(key, f"applies only with {path_key}"))
        return res
    name = given.get(name_key, "compute_score")  # verl's default function name
    res.rows.append(Row(tuple(given), "reward.custom_fn", f"{path}:{name}"))
    return res


def resume(given: Mapping, ctx: Context) -> GroupResult:
    res = GroupResult()
    mode_key, path_key = "trainer.resume_mode", "trainer.resume_from_path"
    mode = given.get(mode_key, "auto")
    if mode in ("auto", "disable"):
        if mode_key in given:
            res.rows.append(Row((mode_key,), "trainer.resume", mode))
        if given.get(path_key) is not None:
            res.notices.append(Notice(path_key, f"used only with {mode_key}=resume_path"))
    elif mode == "resume_path" and given.get(path_key) is not None:
        res.rows.append(Row((mode_key, path_key), "trainer.resume", str(given[path_key])))
    elif mode == "resume_path":
        res.problems.append(f"{mode_key} = resume_path needs {path_key}=<checkpoint directory>")
    else:
        res.problems.append(f"{mode_key} = {mode!r} is unknown: use auto, disable or resume_path")
    return res


def run_length(given: Mapping, ctx: Context) -> GroupResult:
    res = GroupResult()
    epochs_key, steps_key = "trainer.total_epochs", "trainer.total_training_steps"
    if given.get(steps_key) is not None:  # verl: total_training_steps wins over epochs
        res.rows.append(Row((steps_key,), "trainer.total_steps", int(given[steps_key])))
        res.rows.append(Row((steps_key,), "trainer.total_epochs", None))
        if epochs_key in given:
            res.notices.append(Notice(epochs_key, f"unused: {steps_key} is set"))
    elif epochs_key in given:
        epochs = int(given[epochs_key])
        res.rows.append(
            Row((epochs_key,), "trainer.total_epochs", epochs, ("trainer.total_steps",))
        )
    return res


def sampling(given: Mapping, ctx: Context) -> GroupResult:
    res = GroupResult()
    temp_key, sample_key = ROLLOUT + "temperature", ROLLOUT + "do_sample"
    if not as_bool(given.get(sample_key, True)):
        res.rows.append(Row(tuple(given), "rollout.temperature", 0.0))  # greedy
    elif temp_key in given:
        res.rows.append(Row((temp_key,), "rollout.temperature", float(as_number(given[temp_key]))))
    return res


def validation_sampling(given: Mapping, ctx: Context) -> GroupResult:
    """verl validates greedily unless val_kwargs.do_sample=True."""
    res = GroupResult()
    val = ROLLOUT + "val_kwargs."
    for name in ("top_p", "top_k"):
        if val + name in given:
            res.notices.append(Notice(val + name, f"validation samples with rollout.{name}"))
    src = tuple(k for k in given if not k.endswith(("top_p", "top_k")))
    if not src:
        return res
    if as_bool(given.get(val + "do_sample", False)):
        temperature = float(as_number(given.get(val + "temperature", 0)))
        res.rows.append(Row(src, "rollout.val_temperature", temperature))
        res.rows.append(Row(src, "rollout.val_n", int(given.get(val + "n", 1))))
    else:
        res.rows.append(Row(src, "rollout.val_temperature", 0.0))
        res.rows.append(Row(src, "rollout.val_n", 1))
    return res


def rollout_correction(given: Mapping, ctx: Context) -> GroupResult:
    """Token-level truncated importance weights are ours (actor.rollout_is_cap)."""
    res = GroupResult()
    rc = "algorithm.rollout_correction."
    level = given.get(rc + "rollout_is")
    if level == "token":
        cap = float(as_number(given.get(rc + "rollout_is_threshold", 2.0)))
        src = tuple(k for k in (rc + "rollout_is", rc + "rollout_is_threshold") if k in given)
        res.rows.append(Row(src, "actor.rollout_is_cap", cap))
    elif level is not None:
        res.problems.append(
            f"{rc}rollout_is = {level!r} asks for sequence-level importance weights, which "
            "hybridflow does not have: use rollout_is=token (actor.rollout_is_cap)"
        )
    elif rc + "rollout_is_threshold" in given:
        res.notices.append(Notice(rc + "rollout_is_threshold", f"used only with {rc}rollout_is"))
    for key, feature in (
        ("rollout_rs", "rejection sampling of mismatched rollouts"),
        ("bypass_mode", "the rollout-correction bypass mode"),
        ("rollout_is_batch_normalize", "batch-normalised importance weights"),
    ):
        if given.get(rc + key) not in (None, False, "false", "False"):
            res.problems.append(f"{rc}{key} asks for {feature}, which hybridflow does not have")
    if rc + "loss_type" in given and given[rc + "loss_type"] != "ppo_clip":
        res.problems.append(f"{rc}loss_type = {given[rc + 'loss_type']!r}: only ppo_clip is here")
    return res


def overlong_reward(given: Mapping, ctx: Context) -> GroupResult:
    """DAPO's overlong shaping (verl: reward_kwargs.overlong_buffer_cfg of the dapo manager)."""
    res = GroupResult()
    cfg = "reward_model.reward_kwargs.overlong_buffer_cfg."
    if not as_bool(given.get(cfg + "enable", False)):
        res.rows.append(Row(tuple(given), "reward.overlong_buffer_len", 0))
        return res
    src = tuple(given)
    res.rows.append(Row(src, "reward.overlong_buffer_len", int(given.get(cfg + "len", 0))))
    factor = float(as_number(given.get(cfg + "penalty_factor", 1.0)))
    res.rows.append(Row(src, "reward.overlong_penalty_factor", factor))
    if cfg + "log" in given:
        res.notices.append(Notice(cfg + "log", "the overlong penalty is always logged"))
    return res


def routing_replay(given: Mapping, ctx: Context) -> GroupResult:
    """verl's rollout routing replay (R3): the engine records each token's experts, the actor
    replays them -> actor.router_replay=rollout. R2 (replaying the trainer's own old-log-prob
    routing) is not here."""
    res = GroupResult()
    mode_key, enable_key = ACTOR + "router_replay.mode", ROLLOUT + "enable_rollout_routing_replay"
    mode = str(given.get(mode_key, "disabled"))
    enable = as_bool(given.get(enable_key, False))
    if mode not in ("disabled", "R2", "R3"):
        res.problems.append(f"{mode_key} = {mode!r} is unknown: verl's modes are disabled, R2, R3")
    elif mode == "R2":
        res.lacks("MoE router replay of the trainer's own routing (R2)", f"{mode_key}=R2")
    else:
        replay = "rollout" if mode == "R3" or enable else "off"
        res.rows.append(Row(tuple(given), "actor.router_replay", replay))
        if mode == "R3" and enable_key in given and not enable:
            res.notices.append(Notice(enable_key, f"implied by {mode_key}=R3 (the engine records)"))
    return res


RM = "reward_model."


def reward_model(given: Mapping, ctx: Context) -> GroupResult:
    """verl's reward model (``reward_model.enable``): its path, batching and offload become
    reward.model.*; it replaces the rule reward, as reward.weights' default does."""
    res = GroupResult()
    if not as_bool(given.get(RM + "enable", False)):
        for key in given:
            if key != RM + "enable":
                res.notices.append(Notice(key, f"applies only with {RM}enable=True"))
        return res
    path = given.get(RM + "model.path")
    if path is None:
        res.problems.append(f"{RM}enable=True needs {RM}model.path (a local "
                            f"*ForSequenceClassification checkpoint)")  # fmt: skip
        return res
    res.rows.append(Row((RM + "enable", RM + "model.path"), "reward.model.path", str(path)))
    if RM + "micro_batch_size_per_gpu" in given:
        res.rows.append(Row((RM + "micro_batch_size_per_gpu",),
                            "reward.model.micro_batch_size_per_gpu",
                            int(as_number(given[RM + "micro_batch_size_per_gpu"]))))  # fmt: skip
    elif RM + "micro_batch_size" in given:  # verl's global size, over the devices
        value = int(as_number(given[RM + "micro_batch_size"]))
        res.rows.append(Row((RM + "micro_batch_size",), "reward.model.micro_batch_size_per_gpu",
                            max(1, value // ctx.world_size())))  # fmt: skip
    if as_bool(given.get(RM + "use_dynamic_bsz", False)):
        budget = int(as_number(given.get(RM + "forward_max_token_len_per_gpu", 32768)))
        keys = tuple(k for k in (RM + "use_dynamic_bsz", RM + "forward_max_token_len_per_gpu")
                     if k in given)  # fmt: skip
        res.rows.append(Row(keys, "reward.model.max_tokens_per_gpu", budget))
    elif RM + "forward_max_token_len_per_gpu" in given:
        res.notices.append(Notice(RM + "forward_max_token_len_per_gpu",
                                  f"used only with {RM}use_dynamic_bsz=True"))  # fmt: skip
    offload = RM + "model.fsdp_config.param_offload"
    if offload in given:
        res.rows.append(Row((offload,), "reward.model.param_offload", as_bool(given[offload])))
    strategy = given.get(RM + "strategy")
    if strategy is not None and strategy not in ("fsdp", "fsdp2"):
        res.lacks(f"a {strategy} reward model (hybridflow runs it in its own runtime)",
                  f"{RM}strategy={strategy}")  # fmt: skip
    elif strategy is not None:
        res.notices.append(Notice(RM + "strategy", "the reward model runs in hybridflow's "
                                  "runtime, a full copy on each of its devices"))  # fmt: skip
    reward_model_pool(given, res)
    if given.get(RM + "model.input_tokenizer") is not None:
        res.notices.append(Notice(RM + "model.input_tokenizer", "the conversation is rendered "
                                  "again with the reward model's tokenizer whenever it differs "
                                  "from the policy's"))  # fmt: skip
    return res


def reward_model_pool(given: Mapping, res: GroupResult) -> None:
    """``reward_model.enable_resource_pool``: the reward model on ``n_gpus_per_node`` devices
    of its own beside the trainer's (one node) -> reward.model.n_gpus_per_node."""
    keys = [RM + k for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes")]
    if not as_bool(given.get(keys[0], False)):
        res.notices += [Notice(k, f"applies only with {keys[0]}=True") for k in keys[1:]
                        if k in given]  # fmt: skip
        return
    devices, nodes = int(as_number(given.get(keys[1], 0))), int(as_number(given.get(keys[2], 1)))
    if devices < 1 or nodes < 1:
        res.problems.append(f"{keys[0]}=True needs {keys[1]} >= 1 and {keys[2]} >= 1 (the "
                            f"reward model's own devices), got {devices} and {nodes}")  # fmt: skip
    elif nodes > 1:
        res.lacks("a reward model on devices of its own over several nodes",
                  f"{keys[2]}={nodes}")  # fmt: skip
    else:
        res.rows.append(Row(tuple(k for k in keys if k in given),
                            "reward.model.n_gpus_per_node", devices))  # fmt: skip
