"""Timing a connector's hooks: every call, wall clock and thread CPU, and per-step totals."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from pushkv.bench.hooks.config import PER_REQUEST_HOOKS
from pushkv.bench.stats import percentile


class HookTimer:
    """Wraps a connector's methods; records every call and per-step totals.

    Only outermost calls count towards the step total (a hook may call another
    timed one)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = defaultdict(list)  # wall-clock ns per call
        self.cpu: dict[str, list[int]] = defaultdict(list)  # this thread's CPU ns per call
        self.step_ns = 0
        self.step_cpu_ns = 0
        self.step_request_calls = 0  # calls of per-request hooks this step
        self.step_parts: dict[str, int] = defaultdict(int)  # wall ns per hook this step
        self._depth = 0

    def wrap(self, obj: Any, names: Sequence[str]) -> None:
        for name in names:
            fn = getattr(obj, name)
            setattr(obj, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        calls, cpu = self.calls[name], self.cpu[name]
        per_request = name in PER_REQUEST_HOOKS

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            if per_request:
                self.step_request_calls += 1
            c = time.thread_time_ns()
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                d = time.perf_counter_ns() - t
                dc = time.thread_time_ns() - c
                cpu.append(dc)
                self._depth -= 1
                calls.append(d)
                if self._depth == 0:
                    self.step_ns += d
                    self.step_cpu_ns += dc
                    self.step_parts[name] += d

        return timed

    def take_parts(self) -> dict[str, int]:
        """Wall ns of this step's outermost calls, by hook; resets them."""
        out = dict(self.step_parts)
        self.step_parts.clear()
        return out

    def take_step(self) -> tuple[int, int]:
        """(wall ns, CPU ns) of this step's outermost hook calls; resets both."""
        out = (self.step_ns, self.step_cpu_ns)
        self.step_ns = self.step_cpu_ns = 0
        return out

    def take_request_calls(self) -> int:
        n, self.step_request_calls = self.step_request_calls, 0
        return n


def timer_overhead(n: int = 20_000) -> tuple[float, float]:
    """(wall ns, CPU ns) that HookTimer itself adds to one call: a timed no-op, median."""

    class _Noop:
        def hook(self) -> None:
            return None

    obj = _Noop()
    timer = HookTimer()
    timer.wrap(obj, ("hook",))
    for _ in range(n):
        obj.hook()
    return percentile(timer.calls["hook"], 50), percentile(timer.cpu["hook"], 50)
