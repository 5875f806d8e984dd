"""Bounded waits for state owned by another thread (tests only)."""

from __future__ import annotations

import time
from collections.abc import Callable

DEADLINE_S = 10.0


def wait_until(
    cond: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S, every_s: float = 0.001
) -> None:
    """Poll `cond` every `every_s` until it holds; fail with `what` once
    `deadline_s` has passed."""
    deadline = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        time.sleep(every_s)
