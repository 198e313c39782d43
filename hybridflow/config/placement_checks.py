"""validate()'s device and placement rules: the devices a run asks for against the node's,
the backend that spreads them, colocated or split training and rollout, and the data-parallel
ranks of each role once the layouts (parallel_checks.py) tile them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridflow.config.parallel_checks import check_layouts, roles_in_use
from hybridflow.config.sections import Config
from hybridflow.parallel.roles import RoleLayouts

Add = Callable[[str], None]


@dataclass(frozen=True)
class Placement:
    """Where a run's roles go, as validate() reads it."""

    train_world: int  # the training roles' devices
    ranks: dict[str, int]  # data-parallel ranks per role (actor, ref, critic, rollout)
    layouts: RoleLayouts | None  # None while a layout does not tile (that problem is said)
    use_reference: bool
    use_critic: bool


def check_devices(cfg: Config, gpus_available: int | None, add: Add) -> int:
    """trainer.nnodes, n_gpus_per_node, backend and device against the node's GPUs (and
    the reward model's pool beside them); -> the devices of the run (at least 1)."""
    t = cfg.trainer
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
    return world


def check_placement(cfg: Config, world: int, add: Add, planning: bool) -> Placement:
    """trainer.placement (colocate, or split with trainer.rollout_gpus) and each role's
    layout over its devices (check_layouts)."""
    t, a, alg = cfg.trainer, cfg.actor, cfg.algorithm
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
    return Placement(train_world, ranks, layouts, use_reference, use_critic)


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
