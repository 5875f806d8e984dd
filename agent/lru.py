"""A bounded memory of keys, for the agent's duplicate checks."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")
REMEMBER = 50_000  # finished orders / transfers remembered for duplicates


class Lru(Generic[V]):
    """Bounded memory of keys (optionally with a value); the oldest go first."""

    def __init__(self, limit: int = REMEMBER) -> None:
        self._d: OrderedDict[str, V | None] = OrderedDict()
        self._limit = limit

    def add(self, key: str, value: V | None = None) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self._limit:
            self._d.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def get(self, key: str) -> V | None:
        return self._d.get(key)
