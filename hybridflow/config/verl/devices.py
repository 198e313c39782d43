"""Device keys of a verl command line: the rollout's tensor parallelism and the backend.

verl's ``rollout.tensor_model_parallel_size`` becomes ``rollout.tensor_parallel_size`` once
the engine runs tensor-parallel (config/parallel_checks.py lists the layouts that run). Until
then it is accepted with a notice that names the bytes each replica's weights take, estimated
from the model's config.json or preset: the engine runs one full replica per device, which
changes memory and speed but not what is sampled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from hybridflow.config import parallel_checks
from hybridflow.config.verl.rules import Context, GroupResult, Notice, Row
from hybridflow.config.verl.table import MODEL, ROLLOUT

BYTES_PER_PARAMETER = 2  # bf16, the engine's dtype on GPUs


def weights_bytes(model_path: str) -> int | None:
    """bf16 bytes of the model's weights from its config.json or shape preset; None if unknown."""
    try:
        from hybridflow.models.architecture import ModelArchitecture

        config = Path(model_path).expanduser() / "config.json"
        if config.is_file():
            arch = ModelArchitecture.from_hf(json.loads(config.read_text()))
        else:
            from hybridflow.models.presets import PRESETS  # imports torch: only when needed

            if model_path not in PRESETS:
                return None
            arch = PRESETS[model_path]
        return arch.num_parameters() * BYTES_PER_PARAMETER
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None


def tensor_parallel(given: Mapping, ctx: Context) -> GroupResult:
    key = ROLLOUT + "tensor_model_parallel_size"
    size = int(given[key])
    if ("rollout", "tp") in parallel_checks.SUPPORTED_LAYOUTS:
        return GroupResult(rows=[Row((key,), "rollout.tensor_parallel_size", size)])
    if size == 1:
        return GroupResult(notices=[Notice(key, "the engine runs one replica per device")])
    path = str(ctx.verl.get(MODEL + "path", ctx.ours.get("model.path", "")))
    weights = weights_bytes(path)
    fits = (
        f"its weights take {weights / 1e9:.1f} GB (bf16) on each device"
        if weights is not None
        else f"the size of {path!r} is unknown here: a full copy must fit on one device"
    )
    why = (
        f"tensor parallelism is not in the engine yet: it runs one replica per device "
        f"instead of one per {size} devices; {fits}"
    )
    return GroupResult(notices=[Notice(key, why)])


def backend(ctx: Context, given_ours: Mapping) -> Row | None:
    """verl runs every job on Ray; here one node with several devices uses the ``local``
    backend, several nodes ``ray``, one device ``inprocess`` (the default)."""
    if "trainer.backend" in given_ours or ctx.ours.get("trainer.backend") != "inprocess":
        return None
    nodes, world = ctx.count("trainer.nnodes"), ctx.world_size()
    if world == 1:
        return None
    src = tuple(k for k in ("trainer.nnodes", "trainer.n_gpus_per_node") if k in given_ours)
    return Row(src, "trainer.backend", "ray" if nodes > 1 else "local")
