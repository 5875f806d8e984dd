"""Which asyncio event loop a server runs on (`--event-loop`), for its start
log, and how late it runs (the coordinator's `/metrics`, the cluster bench's
hosts)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

LAG_TICK_S = 0.005  # the loop-lag sampler's timer


def event_loop_name() -> str:
    """The running event loop's package: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


async def sample_loop_lag(observe: Callable[[float], None], tick_s: float = LAG_TICK_S) -> None:
    """Until cancelled: how late this loop runs a `tick_s` timer, in seconds,
    to `observe`. What is ready ahead of the timer delays every message read
    meanwhile too. (An idle sample may hold up to 1 ms of epoll's
    millisecond timeout.)"""
    while True:
        t = time.monotonic()
        await asyncio.sleep(tick_s)  # a measurement tick, not synchronisation
        observe(max(time.monotonic() - t - tick_s, 0.0))
