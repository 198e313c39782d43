"""Whether this machine can host a run (``hybridflow train`` and ``hybridflow sft`` alike):
a visible GPU when the run asks for one, a writable run directory with room for a checkpoint,
the packages of the loggers it names. Part of the preflight checks (preflight.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from hybridflow.config import Config
from hybridflow.install_hint import extra_install
from hybridflow.trainer.plan.architecture import model_architecture

LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""trainer.loggers entry -> the package it needs (pip names: the same)."""

MIN_FREE_BYTES = 64 * 2**20
"""Free space the run directory needs at least (metrics, a tiny model's checkpoint)."""


def runs_here(device: str) -> bool:
    """Whether this machine can be the run's: any but ``trainer.device=cuda`` without a
    visible GPU (a login node or laptop where a cluster's config is checked)."""
    if device != "cuda":
        return True
    import torch

    return torch.cuda.is_available()


def machine_problems(cfg: Config, out_dir: str) -> list[str]:
    """The device, a writable ``out_dir`` with room for a checkpoint, the logger packages."""
    return (
        device_problems(cfg.trainer.device, cfg.trainer.n_gpus_per_node)
        + run_dir_problems(out_dir, _checkpoint_bytes(cfg))
        + logger_problems(cfg.trainer.loggers)
    )


def device_problems(device: str, n_gpus_per_node: int) -> list[str]:
    """``trainer.device=cuda`` needs a visible GPU (else the workers wait for one forever)."""
    if device != "cuda":
        return []
    import torch

    if torch.cuda.is_available():
        return []
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return [
        f"trainer.device = cuda but no CUDA GPU is visible here (torch {torch.__version__} is "
        f"{build}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
        f"set trainer.device=cpu (or auto), or run on a machine with a GPU"
    ]


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def run_dir_problems(run_dir: str, need_bytes: int) -> list[str]:
    """The run directory (or the nearest parent that exists) is a writable directory with
    ``need_bytes`` free (what a checkpoint needs)."""
    return writable_dir_problems("trainer.run_dir", run_dir, need_bytes, "a checkpoint")


def writable_dir_problems(key: str, directory: str, need_bytes: int, what: str) -> list[str]:
    """``directory`` (or the nearest parent that exists) is a writable directory with
    ``need_bytes`` free for ``what``. Nothing is created: a probe file is written and removed."""
    path = Path(directory).expanduser()
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return [f"{key} = {directory}: {existing} is a file, not a directory"]
    try:  # os.access is not enough: root passes it, and read-only mounts need a write
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".hybridflow-write-check-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        return [
            f"{key} = {directory}: cannot write in {existing} ({error.strerror}), where "
            f"{what} goes: choose a writable directory"
        ]
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        return [
            f"{key} = {directory}: {free / 2**20:.0f} MiB free at {existing}, {what} needs "
            f"about {need_bytes / 2**20:.0f} MiB: free some space or choose another directory"
        ]
    return []


def _checkpoint_bytes(cfg: Config) -> int:
    """fp32 weights + AdamW's two moments (12 bytes a parameter), when the size is known
    (for ``sft:<task>``, that of the ``sft.preset`` it trains)."""
    if cfg.trainer.save_freq < 0:
        return MIN_FREE_BYTES
    path = cfg.sft.preset if cfg.model.path.startswith("sft:") else cfg.model.path
    architecture = model_architecture(path)
    if architecture is None:
        return MIN_FREE_BYTES
    return max(MIN_FREE_BYTES, 12 * architecture.num_parameters())


def logger_problems(loggers: list[str]) -> list[str]:
    return [
        f"trainer.loggers includes {name!r} but the {package!r} package is not installed: "
        f"{extra_install(name)}, or drop it from trainer.loggers"
        for name, package in LOGGER_PACKAGES.items()
        if name in loggers and importlib.util.find_spec(package) is None
    ]
