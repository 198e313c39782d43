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
