"""Name -> function registries: the strings a user writes in a config select the math."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F")   # a function, or a spec object (losses.distill.DistillLoss)


class Registry(Generic[F]):
    """A dict of named functions that refuses silent overwrites and explains unknown names.
    An entry may declare facts about itself (`register(name, reads=...)`), read with `meta`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            if name in self._fns and self._fns[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered to "
                                 f"{self._fns[name].__qualname__}")
            self._fns[name] = fn
            self._meta[name] = meta
            return fn
        return decorate

    def meta(self, name: str) -> dict[str, Any]:
        """What entry `name` declared when it was registered ({} if nothing)."""
        self[name]   # an unknown name is explained
        return self._meta[name]

    def __getitem__(self, name: str) -> F:
        try:
            return self._fns[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {sorted(self._fns)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._fns))

    def names(self) -> list[str]:
        return sorted(self._fns)
