"""Clocks. The core never reads time itself, so tests drive it with FakeClock."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    # The C functions themselves: no Python frame per clock read.
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)


class FakeClock:
    """Manually advanced clock; wall time moves with monotonic time."""

    def __init__(self, start: float = 1_000.0, wall_offset: float = 1.7e9) -> None:
        self._now = start
        self._wall_offset = wall_offset

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        self._now += seconds
