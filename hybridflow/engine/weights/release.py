"""The engine's weight storage freed between a generation and the weight sync that rewrites
it (rollout.release_weights): discarded, not saved, as vLLM's sleep level 2.

Each parameter's storage is resized to 0 bytes in place and back to its size just before the
sync writes it. The tensor and storage objects stay, so everything that holds them keeps
working: views, tied weights (one storage), the modules, the reshard's targets
(engine/reshard.py keeps the engine's parameters). Only the address may change.

Captured decode graphs read the weights at their capture addresses. They stay valid where
the allocator hands the same addresses back and are captured again where it does not:
DecodeRunner.check_weights compares every parameter's address when generation starts and
drops the graphs of moved ones (engine/graphs.py). With rollout.release_cache (the default)
Engine.release drops them after every generation anyway, since the KV cache they point into
moves too, so releasing the weights adds no capture. Keeping addresses fixed across a free
would take a virtual-memory allocator (cuMemMap, vLLM's CuMemAllocator), which buys nothing
here.

Buffers (rotary tables, DeepSeek's score-correction bias) are kept: the reshard moves
parameters only. A storage that cannot be resized (a memory-mapped checkpoint on the CPU) is
kept too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ReleasedWeights:
    """The parameter storages freed by :func:`release_parameters`, and what each held."""

    storages: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    """Each freed storage with its size in bytes."""
    views: dict[tuple, list[str]] = field(default_factory=dict)
    """Each distinct tensor over a freed storage (storage, offset, shape, stride) -> the
    parameter names that are it (a tied lm_head shares the embedding's)."""

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.storages)

    def restore(self) -> None:
        """Every storage back at its size, its contents undefined until the sync writes it."""
        for storage, size in self.storages:
            storage.resize_(size)

    def unwritten(self, written: set[str]) -> list[str]:
        """A name of each freed tensor none of whose names is in ``written``."""
        return [names[0] for names in self.views.values() if written.isdisjoint(names)]


def release_parameters(model: torch.nn.Module) -> ReleasedWeights:
    """Free the storage of every parameter of ``model`` (module docstring)."""
    released = ReleasedWeights()
    storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        storage = param.untyped_storage()
        if storage.nbytes() == 0 or not storage.resizable():
            continue
        key = storage._cdata  # the storage itself: each call wraps it in a new object
        storages.setdefault(key, (storage, storage.nbytes()))
        view = (key, param.storage_offset(), tuple(param.shape), param.stride())
        released.views.setdefault(view, []).append(name)
    released.storages = list(storages.values())
    for storage, _ in released.storages:
        storage.resize_(0)
    return released


def check_rewritten(released: ReleasedWeights | None, written: set[str]) -> None:
    """RuntimeError naming a freed weight that the sync did not write (its contents would be
    whatever the allocator left there)."""
    if released is None:
        return
    missing = released.unwritten(written)
    if missing:
        raise RuntimeError(
            f"rollout.release_weights: the weight sync did not rewrite {len(missing)} freed "
            f"weight(s) of the engine, e.g. {missing[:3]}: set rollout.release_weights=false"
        )
