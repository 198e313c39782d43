"""Whether checkpoints are written in the background (trainer.async_save).

A background save holds a host copy of every rank's training state for the whole run (fp32
weights and AdamW's two moments: 12 bytes a trained parameter), so its default depends on
the size: on unless that copy would take more than a quarter of the host's memory (a 7B
full-parameter run: ~84 GiB), or the state already lives on the host (actor.optimizer_offload:
a second copy would double it). A value the user set is kept.
"""

from __future__ import annotations

import dataclasses
import os

from hybridflow.config import Config

BYTES_PER_TRAINED_PARAMETER = 12  # fp32 master + exp_avg + exp_avg_sq
HOST_SHARE = 0.25


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_copy_bytes(cfg: Config, critic: bool = False) -> int | None:
    """The background save's host copy on one host (every rank's shard; the critic's too),
    None if unknown."""
    from hybridflow.trainer.plan.architecture import model_architecture

    if cfg.model.lora_rank > 0:
        return 0  # the adapters only: small
    architecture = model_architecture(cfg.model.path)
    if architecture is None:
        return None
    return architecture.num_parameters() * BYTES_PER_TRAINED_PARAMETER * (2 if critic else 1)


def background_save(cfg: Config, host_bytes: int | None,
                    critic: bool = False) -> tuple[bool, str | None]:  # fmt: skip
    """(write in the background, why not) for trainer.async_save = null."""
    if cfg.actor.optimizer_offload:
        return False, "actor.optimizer_offload keeps the state in host memory already"
    copy = host_copy_bytes(cfg, critic)
    if copy is None or host_bytes is None:
        return True, None
    if copy > HOST_SHARE * host_bytes:
        return False, (f"its host copy ({copy / 2**30:.0f} GiB) would take more than a quarter "
                       f"of this host's {host_bytes / 2**30:.0f} GiB")  # fmt: skip
    return True, None


def save_defaults(cfg: Config, log, critic: bool = False,
                  host_bytes: int | None = None) -> Config:  # fmt: skip
    """trainer.async_save resolved to true/false (a line when the default turns it off)."""
    if cfg.trainer.async_save is not None:
        return cfg
    host_bytes = host_memory_bytes() if host_bytes is None else host_bytes
    background, why = background_save(cfg, host_bytes, critic)
    if not background:
        log(f"checkpoints: written in the foreground, {why} (trainer.async_save=true to insist)")
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, async_save=background))
