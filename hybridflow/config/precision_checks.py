"""actor.precision and critic.precision (FP8 training, learners/fp8_training.py): the values,
and what FP8 training cannot run with. The GPU's compute capability is checked when the role
starts (it is not known here)."""

from __future__ import annotations

from hybridflow.config.sections import Config

PRECISIONS = ("bf16", "fp8")
FP8_RECIPES = ("rowwise", "tensorwise")


def precision_problems(cfg: Config, *, use_critic: bool) -> list[str]:
    """One line per problem, naming the key and the fix."""
    roles = [("actor", cfg.actor, cfg.actor.tensor_parallel_size)]
    if use_critic:
        tp = cfg.critic.tensor_parallel_size or cfg.actor.tensor_parallel_size
        roles.append(("critic", cfg.critic, tp))
    problems = []
    for role, section, tensor_parallel in roles:
        key = f"{role}.precision"
        if section.precision not in PRECISIONS:
            problems.append(f"{key} = {section.precision!r} is unknown: use bf16 or fp8")
            continue
        if section.fp8_recipe not in FP8_RECIPES:
            problems.append(f"{role}.fp8_recipe = {section.fp8_recipe!r} is unknown: use "
                            "rowwise (a scale per row) or tensorwise (one per tensor)")  # fmt: skip
        if section.precision != "fp8":
            continue
        if cfg.trainer.device == "cpu":
            problems.append(f"{key} = fp8 needs a CUDA GPU of compute capability >= 8.9 (H100, "
                            f"H200, L40S...), and trainer.device = cpu: set {key}=bf16")  # fmt: skip
        if tensor_parallel > 1:
            problems.append(f"{key} = fp8 with {role}.tensor_parallel_size = {tensor_parallel} "
                            f"is not supported (the split linears would need float8 tensor-"
                            f"parallel styles): set {role}.tensor_parallel_size=1 (FSDP2 shards "
                            f"the weights instead) or {key}=bf16")  # fmt: skip
    return problems
