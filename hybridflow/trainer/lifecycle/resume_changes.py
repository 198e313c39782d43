"""What changed in the config since a checkpoint was written, and whether a resumed run
can honour it.

Most keys are read afresh at every step (temperatures, clip ratios, frequencies, loggers):
they simply take effect. Optimizer settings are re-applied over the loaded optimizer
(learners/sharded_checkpoint.py: the moments are kept, the peak LR and weight decay are this run's).
Keys that fix what the checkpoint holds (the model, the data order, the device layout, the
batch geometry the LR schedule was sized for) cannot change in the middle of a run: resuming
with them changed stops with the reason and the way out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

APPLIED = {
    "actor.lr": "the optimizer continues with the new peak learning rate",
    "critic.lr": "the critic's optimizer continues with the new peak learning rate",
    "actor.weight_decay": "applied to the loaded optimizer",
    "critic.weight_decay": "applied to the loaded optimizer",
    "trainer.total_steps": "the run now ends at the new step",
    "algorithm.kl_coef": "a fixed KL controller continues at the new coefficient; an "
    "adaptive one keeps the value it adapted to",
    **{
        f"rollout.{size}": "the rollout keeps no state: its engine is built in the new layout "
        "and takes the loaded actor's weights; the samples are the same"
        for size in ("tensor_parallel_size", "expert_parallel_size")
    },
    **{
        f"{role}.precision": "the checkpoint holds the same fp32/bf16 weights and AdamW state "
        "in either precision (FP8 casts them at each matmul): the linears compute in the new "
        "one from the next step"
        for role in ("actor", "critic")
    },
    **{
        f"{role}.fp8_recipe": "FP8 scales are taken afresh at each matmul, none is saved: "
        "the new recipe applies from the next step"
        for role in ("actor", "critic")
    },
    "rollout.dtype": "the rollout keeps no state: its engine takes the loaded actor's weights "
    "in the new format",
    **{
        f"{role}.{size}": "each rank reads its part of the checkpoint's shards in the new layout"
        for role in ("actor", "ref", "critic")
        for size in ("tensor_parallel_size", "sequence_parallel_size", "expert_parallel_size")
    },
}

_NEW_RUN = "start a new run (another trainer.run_dir, or trainer.resume=disable)"
REFUSED = {
    "model.path": "the checkpoint holds the weights of the model it was started from",
    "model.lora_rank": "the checkpoint holds adapters of the old rank",
    "model.lora_target_modules": "the checkpoint holds adapters of the old modules",
    "trainer.seed": "the data order and the sampling seeds follow the seed",
    "data.train_files": "the data position counts prompts of the old files",
    "data.shuffle": "the data position follows the old order",
    "data.prompt_key": "the data position counts prompts of the old column",
    "data.max_prompt_length": "filtering overlong prompts changes the prompts the data "
    "position counts",
    "data.overlong_prompts": "filtering overlong prompts changes the prompts the data "
    "position counts",
    "data.builtin_train_size": "the data position counts prompts of the old task size",
    "data.train_batch_size": "the data position and the learning-rate schedule (optimizer "
    "steps per RL step) were set for the old batch size",
    "actor.ppo_mini_batch_size": "the learning-rate schedule counts optimizer steps of the "
    "old mini-batch size",
    "actor.ppo_epochs": "the learning-rate schedule counts optimizer steps of the old epochs",
    "trainer.nnodes": "the optimizer state is sharded over the old number of ranks",
    "trainer.n_gpus_per_node": "the optimizer state is sharded over the old number of ranks",
    "trainer.placement": "the optimizer state is sharded over the old training ranks",
    "trainer.rollout_gpus": "the optimizer state is sharded over the old training ranks",
    "algorithm.adv_estimator": "the checkpoint holds (or lacks) the critic of the old estimator",
}

NOT_REPORTED = ("trainer.resume",)


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    current: Any

    def line(self) -> str:
        how = APPLIED.get(self.key, REFUSED.get(self.key, "takes effect from now on"))
        return f"{self.key}: {self.saved!r} -> {self.current!r} ({how})"


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"actor": {"lr": 1e-3}}`` -> ``{"actor.lr": 1e-3}`` (nested groups too)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_changes(saved: dict, current: dict) -> list[Change]:
    """Keys whose value differs between the checkpoint's config and this run's."""
    old, new = flatten(saved), flatten(current)
    return [
        Change(key, old.get(key), new.get(key))
        for key in sorted(set(old) | set(new))
        if key not in NOT_REPORTED and old.get(key) != new.get(key)
    ]


def refused(changes: list[Change]) -> list[Change]:
    return [change for change in changes if change.key in REFUSED]


def refusal_message(checkpoint: str, changes: list[Change]) -> tuple[str, str]:
    """(message, fix) for resuming with keys that cannot change mid-run."""
    lines = "; ".join(change.line() for change in changes)
    return (
        f"cannot resume {checkpoint} with a changed config: {lines}",
        f"put the old values back to continue that run, or {_NEW_RUN}",
    )
