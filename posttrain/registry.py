"""Name -> function registries: the strings a user writes in a config select the math."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F")   # a function, or a spec object (losses.DistillLoss)


class Registry(Generic[F]):
    """A dict of named functions that refuses silent overwrites and explains unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            if name in self._fns and self._fns[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered to "
                                 f"{self._fns[name].__qualname__}")
            self._fns[name] = fn
            return fn
        return decorate

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
