"""``trainer.device`` resolved, in a module of its own that imports no torch until it must
answer ``auto``: the memory plan of `hybridflow config plan` and `validate` asks it."""

from __future__ import annotations


def resolve_device(device: str) -> str:
    """``trainer.device``: auto is cuda when a GPU is visible, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
