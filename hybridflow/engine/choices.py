"""Pinned timing choices: what the engine picks by timing (the decode layer per batch bucket,
gate/up matmul kernels, chain tiles, attention tiles) is made once per (model shape, GPU,
dtype, options, library versions) and reused.

Why: timing is noisy. Two processes timing the same candidates can pick different kernels
where two are within a few percent, and different kernels round differently, so a repeated
or resumed run drew different tokens from the same seed. Timing is also slow for big models
(tens of seconds on the first generate() of a 7B model). The choices live in a small JSON
file under the cache directory, keyed by a digest of what they depend on; a run's checkpoint
records them too (Engine.pinned_choices / Engine.pin_choices).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

FORMAT = 1


def identity(config, dtype, device_name: str, options: dict, versions: dict) -> dict:
    """What the choices depend on: the architecture's shape, the dtype, the GPU, the options
    that change what timing chooses, and the torch/Triton versions."""
    shape_fields = ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                    "attention_bias", "qk_norm", "tie_word_embeddings")  # fmt: skip
    shape = {name: getattr(config, name) for name in shape_fields if hasattr(config, name)}
    return {"format": FORMAT, "model": shape, "dtype": str(dtype), "gpu": device_name,
            "options": options, "versions": versions}  # fmt: skip


def digest(identity_: dict) -> str:
    return hashlib.sha256(json.dumps(identity_, sort_keys=True).encode()).hexdigest()[:16]


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples the engine keys and compares with."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


class PinnedChoices:
    """A flat map 'kind:key' -> JSON value, loaded from / saved to one file.

    path: the JSON file (None: in memory only). retune: start empty (the file is replaced at
    the next save)."""

    def __init__(self, path: Path | None = None, identity_: dict | None = None,
                 retune: bool = False):  # fmt: skip
        self.path = Path(path) if path is not None else None
        self.identity = identity_ or {}
        self.entries: dict[str, Any] = {}
        self.dirty = False
        if self.path is not None and self.path.exists() and not retune:
            self.entries = self._read(self.path)

    def _read(self, path: Path) -> dict:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}  # unreadable or half-written by a killed process: time again
        if data.get("identity") != self.identity:
            return {}  # a digest collision or a hand-edited file
        return dict(data.get("choices", {}))

    @staticmethod
    def key(kind: str, key: tuple) -> str:
        return f"{kind}:{key!r}"

    def get(self, kind: str, key: tuple, default: Any = None) -> Any:
        name = self.key(kind, key)
        return _tuples(self.entries[name]) if name in self.entries else default

    def __contains__(self, item: tuple[str, tuple]) -> bool:
        return self.key(*item) in self.entries

    def put(self, kind: str, key: tuple, value: Any) -> None:
        name = self.key(kind, key)
        encoded = json.loads(json.dumps(value))
        if name not in self.entries or self.entries[name] != encoded:  # None is a choice too
            self.entries[name] = encoded
            self.dirty = True

    def update(self, entries: dict) -> None:
        """Add choices recorded elsewhere (a checkpoint); existing keys are replaced."""
        for name, value in entries.items():
            if name not in self.entries or self.entries[name] != value:
                self.entries[name] = value
                self.dirty = True

    def save(self) -> None:
        """Write the file if anything changed (atomically: a reader never sees half a file)."""
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"identity": self.identity, "choices": self.entries}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".choices-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.dirty = False


def choices_path(cache_dir: str | os.PathLike, identity_: dict) -> Path:
    return Path(cache_dir) / "engine-choices" / f"{digest(identity_)}.json"


# -- the engine's pinned set: loaded at construction, recorded after each call, checkpointed ----


def load_engine_choices(config, dtype, device, options) -> PinnedChoices:
    """The choices made by timing for this model, dtype and device, read from
    options.cache_dir (in memory only without one). Needs Triton (its version is keyed)."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    versions = {"torch": torch.__version__, "triton": triton.__version__}
    ident = identity(config, dtype, gpu, options.timing_identity(), versions)
    path = choices_path(options.cache_dir, ident) if options.cache_dir else None
    return PinnedChoices(path, ident, retune=options.retune)


def pin_attention_tiles(pinned: PinnedChoices) -> None:
    """Hand the pinned attention tiles to the attention kernels (which keep them per shape)."""
    from hybridflow.engine.kernels import attention

    entries = {name[len("attention:"):]: value for name, value in pinned.entries.items()
               if name.startswith("attention:")}  # fmt: skip
    attention.pin_tiles(entries)


def record_engine_choices(pinned: PinnedChoices) -> None:
    """The attention tiles timed so far into the pinned set (the other choosers put theirs as
    they choose), saved if any is new."""
    from hybridflow.engine.kernels import attention

    pinned.update({f"attention:{name}": entry
                   for name, entry in attention.tuned_tiles().items()})  # fmt: skip
    pinned.save()


def recorded_choices(pinned: PinnedChoices) -> dict:
    """What a checkpoint records: the identity the choices were made for, and the choices."""
    return {"identity": pinned.identity, "choices": dict(pinned.entries)}


def pin_recorded_choices(pinned: PinnedChoices, recorded: dict, attention: bool) -> bool:
    """Run with choices recorded earlier (recorded_choices() of a run with the same model, GPU,
    dtype, options and versions); False, and nothing changed, when they were made for
    something else. attention: the engine runs the Triton attention kernels (their tiles are
    pinned too)."""
    if recorded.get("identity") != pinned.identity:
        return False
    pinned.update(recorded.get("choices", {}))
    if attention:
        pin_attention_tiles(pinned)
    return True
