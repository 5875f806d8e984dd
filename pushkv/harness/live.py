"""Children a test started and has not stopped yet, for a failed test's
report (tests/support/failure_report.py). Weak references: a child object
dropped without a stop is forgotten with it."""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

T = TypeVar("T")


class Live(Generic[T]):
    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[T]] = {}

    def add(self, item: T) -> None:
        self._refs[id(item)] = weakref.ref(item)

    def discard(self, item: T) -> None:
        self._refs.pop(id(item), None)

    def items(self) -> list[T]:
        """Those added and not discarded, oldest first."""
        return [x for ref in list(self._refs.values()) if (x := ref()) is not None]
