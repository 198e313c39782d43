"""A warm start's finished model, published where the run reads it: written to a temporary
directory, marked COMPLETE (with the SFT settings that made it), then renamed into place, so a
crash mid-write never leaves a directory that looks finished. The text and the image warm
starts (warm_start.py, vision_warm_start.py) both publish through it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from hybridflow.config import SFTConfig

COMPLETE = "COMPLETE"


def publish(model, tokenizer, sft_cfg: SFTConfig, target: Path) -> None:
    """The model and tokenizer at ``target``, atomically (a COMPLETE marker, then a rename)."""
    from hybridflow.trainer.loop.sft_loop import save_hf_model

    temporary = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    save_hf_model(model.to("cpu"), tokenizer, temporary)
    (temporary / COMPLETE).write_text(json.dumps(dataclasses.asdict(sft_cfg)))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(temporary, target)
