"""Bounded waits for state owned by another thread (tests only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

DEADLINE_S = 10.0
T = TypeVar("T")


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


def poll(what: str, check: Callable[[], T], timeout: float) -> T:
    """Poll `check` (another process's state) every 50 ms until it returns a
    truthy value, and return that; fail with `what` and the last value once
    `timeout` has passed."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.05)  # polling other processes under a deadline
    raise AssertionError(f"{what} not within {timeout} s (last: {last!r})")
