"""Name -> function registries, so users can add an estimator or a loss without editing us.

An unknown name raises a ``ValueError`` that lists every known name, because the name
usually comes from a config file and the user needs to see what is available.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RegistryEntry:
    """One registered function plus the options given at registration time."""

    name: str
    fn: Callable[..., Any]
    options: dict[str, Any] = field(default_factory=dict)


class Registry:
    """A dict of named functions filled by a decorator.

    >>> ADVANTAGES = Registry("advantage estimator", config_key="algorithm.adv_estimator")
    >>> @ADVANTAGES.register("mine")
    ... def my_estimator(**inputs): ...
    """

    def __init__(self, kind: str, config_key: str | None = None):
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, RegistryEntry] = {}

    def register(
        self, name: str, *, override: bool = False, **options: Any
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register ``fn`` under ``name``; ``options`` are stored with it.

        Registering an existing name is an error unless ``override=True`` (a silent
        replacement would change what a config means without anyone noticing).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._entries and not override:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered "
                    f"(by {self._entries[name].fn.__module__}.{self._entries[name].fn.__qualname__}); "
                    "pass override=True to replace it"
                )
            self._entries[name] = RegistryEntry(name=name, fn=fn, options=dict(options))
            return fn

        return decorator

    def get(self, name: str) -> RegistryEntry:
        """The entry for ``name``; a ``ValueError`` naming the known ones if absent."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            where = f" (config key {self.config_key})" if self.config_key else ""
            raise ValueError(
                f"unknown {self.kind} {name!r}{where}; known: {', '.join(self.names())}"
            ) from None

    def unregister(self, name: str) -> None:
        """Remove ``name`` (no error if absent); mainly for tests and notebooks."""
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)
