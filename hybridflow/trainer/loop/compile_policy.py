"""Whether the decoder layers are ``torch.compile``d for training (``model.compile``).

``auto`` (the default) is on when the trainer runs on CUDA and off on the CPU. On an H200
the GRPO run end to end is faster compiled (docs/performance.md, GRPO against TRL); the
first step pays the compile, and later runs reuse the compiled artifacts cached under
``trainer.cache_dir`` (workers/compile_cache.py). On the CPU, Inductor's C++ compile of the
layers takes minutes on a small machine and gives little back. A value the user set is kept.
"""

from __future__ import annotations

import dataclasses

from hybridflow.config import Config


def compile_on(value: bool | str, device: str) -> bool:
    """``model.compile`` resolved for a trainer on ``device`` (cuda | cpu, already resolved)."""
    if value == "auto":
        return device == "cuda"
    return value is True


def compile_defaults(cfg: Config, log, device: str | None = None) -> Config:
    """cfg with ``model.compile=auto`` resolved to true/false (a line when it turns it on).
    ``device``: the trainer's device; None resolves ``trainer.device``."""
    if cfg.model.compile != "auto":
        return cfg
    if device is None:
        from hybridflow.trainer.loop.device import resolve_device

        device = resolve_device(cfg.trainer.device)
    on = compile_on("auto", device)
    if on:
        from hybridflow.workers.compile_cache import compile_cache_dir

        log(f"model.compile=auto: on (training on {device}; the first step compiles the "
            f"decoder layers, later runs reuse the artifacts in "
            f"{compile_cache_dir(cfg.trainer.cache_dir)}; model.compile=false to skip)")  # fmt: skip
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=on))
