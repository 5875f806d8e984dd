"""Which asyncio event loop a server runs on (`--event-loop`), for its start
log, how late it runs (the coordinator's `/metrics`, the cluster bench's
hosts), and when it did not run at all for seconds (the coordinator's log)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

LAG_TICK_S = 0.005  # the loop-lag sampler's timer
# A loop that runs its STALL_TICK_S timer at least STALL_S late was stalled.
STALL_TICK_S = 0.1
STALL_S = 2.0


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


async def report_stalls(
    report: Callable[[float], None], tick_s: float = STALL_TICK_S, stall_s: float = STALL_S
) -> None:
    """Until cancelled: `report(seconds)` each time this loop runs a `tick_s`
    timer at least `stall_s` late. The process was kept from running (its host
    paused, its cores oversubscribed) or a call blocked the loop: whoever waits
    on it heard nothing meanwhile, and its log should say so, apart from a
    fault of theirs (agent/starvation.py is the agents' side)."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(tick_s)  # a measurement tick, not synchronisation
        late = time.monotonic() - t - tick_s
        if late >= stall_s:
            report(late)
