"""Bounded waits for state owned by another thread (tests only)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

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


class Lines:
    """A child's text stream read line by line on a thread of its own, so
    that a wait for a line has a deadline (a pipe's readline has none)."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)  # end of stream

    def until(self, marker: str, timeout: float = DEADLINE_S) -> str:
        """Every line up to and including the first holding `marker`; fails
        once `timeout` has passed or the stream ended without one."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line with {marker!r} within {timeout} s: {seen}"
                ) from None
            if line is None:
                raise AssertionError(f"the stream ended with no line with {marker!r}: {seen}")
            seen.append(line)
            if marker in line:
                return "".join(seen)


def process_gone(pid: int) -> bool:
    """No such process, or a zombie (this container's init may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
