"""Device keys of a verl command line: the rollout's tensor parallelism and the backend.

verl's ``rollout.tensor_model_parallel_size`` is ``rollout.tensor_parallel_size``: the ranks of
one engine replica (engine/tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridflow.config.verl.converters import as_bool
from hybridflow.config.verl.rules import Context, GroupResult, Row
from hybridflow.config.verl.table_parts import ROLLOUT


def tensor_parallel(given: Mapping, ctx: Context) -> GroupResult:
    key = ROLLOUT + "tensor_model_parallel_size"
    return GroupResult(rows=[Row((key,), "rollout.tensor_parallel_size", int(given[key]))])


def backend(ctx: Context, given_ours: Mapping) -> Row | None:
    """verl runs every job on Ray; here one node with several devices uses the ``local``
    backend, several nodes ``ray``, one device ``inprocess`` (the default)."""
    if "trainer.backend" in given_ours or ctx.ours.get("trainer.backend") != "inprocess":
        return None
    nodes, world = ctx.count("trainer.nnodes"), ctx.world_size()
    reward_pool = "reward_model.enable_resource_pool"  # the reward model's own devices
    if world == 1 and not (as_bool(ctx.verl.get(reward_pool, False))
                           and as_bool(ctx.verl.get("reward_model.enable", False))):  # fmt: skip
        return None
    src = tuple(k for k in ("trainer.nnodes", "trainer.n_gpus_per_node") if k in given_ours)
    src = src if world > 1 else (reward_pool,)
    return Row(src, "trainer.backend", "ray" if nodes > 1 else "local")
