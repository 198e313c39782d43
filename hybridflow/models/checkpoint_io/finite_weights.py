"""Weights read from a checkpoint are finite: one NaN weight makes every loss and log-prob
NaN, so a checkpoint holding one is refused at load, naming the tensor."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hybridflow.errors import UserError

CHUNK_ELEMENTS = 1 << 24
"""Elements checked at a time: the mask isfinite builds stays at 16 MB whatever the tensor."""


def non_finite_count(tensor: torch.Tensor) -> int:
    """NaN and ±inf entries of ``tensor`` (0 for integer tensors); one pass when all are
    finite, which is the common case."""
    if not tensor.is_floating_point():
        return 0
    flat = tensor.detach().reshape(-1)
    chunks = [flat[i : i + CHUNK_ELEMENTS] for i in range(0, flat.numel(), CHUNK_ELEMENTS)]
    if all(bool(_finite(chunk).all()) for chunk in chunks):
        return 0
    return sum(int((~_finite(chunk)).sum()) for chunk in chunks)


def _finite(chunk: torch.Tensor) -> torch.Tensor:
    if chunk.element_size() == 1:  # fp8: torch has no isfinite for float8_e4m3fn
        chunk = chunk.to(torch.float16)
    return torch.isfinite(chunk)


def check_finite(name: str, tensor: torch.Tensor, source: str) -> None:
    """UserError naming ``source`` (the file or directory) and the tensor when ``tensor``
    holds a NaN or an inf."""
    count = non_finite_count(tensor)
    if count:
        raise UserError(
            f"{source}: tensor {name} holds {count} non-finite value(s) (NaN or inf) among its "
            f"{tensor.numel()}: a model with one computes NaN losses and log-probs",
            "the checkpoint is damaged or was saved by a run that diverged: use an earlier "
            "checkpoint, or copy the model again",
        )


def check_all_finite(named_tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """:func:`check_finite` of every tensor (a model loaded by transformers)."""
    for name, tensor in named_tensors:
        check_finite(name, tensor, source)
