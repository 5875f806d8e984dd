"""Which asyncio event loop a server runs on (`--event-loop`), for its start
log, how late it runs (the coordinator's `/metrics`, the cluster bench's
hosts), and when it did not run at all for seconds (the coordinator's log)."""

from __future__ import annotations

import asyncio
import faulthandler
import time
from collections.abc import Callable

LAG_TICK_S = 0.005  # the loop-lag sampler's timer
# A loop that runs its STALL_TICK_S timer at least STALL_S late was stalled.
STALL_TICK_S = 0.1
STALL_S = 2.0
# How often a hang-dump timer is pushed back (each push starts a C thread).
REARM_S = 1.0
# The longest hang-dump wait taken (faulthandler's timer refuses far longer ones).
MAX_DUMP_AFTER_S = 86400.0


def check_dump_after(seconds: float) -> float:
    """`seconds` if it is a hang-dump wait taken here (0: off), else ValueError."""
    if not 0 <= seconds <= MAX_DUMP_AFTER_S:  # NaN too
        raise ValueError(f"{seconds!r} is not within 0 (off) and {MAX_DUMP_AFTER_S:.0f} s")
    return seconds


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
    report: Callable[[float], None],
    tick_s: float = STALL_TICK_S,
    stall_s: float = STALL_S,
    dump_after_s: float = 0.0,
) -> None:
    """Until cancelled: `report(seconds)` each time this loop runs a `tick_s`
    timer at least `stall_s` late. The process was kept from running (its host
    paused, its cores oversubscribed) or a call blocked the loop: whoever waits
    on it heard nothing meanwhile, and its log should say so, apart from a
    fault of theirs (agent/starvation.py is the agents' side).

    With `dump_after_s` > 0 the loop also keeps faulthandler's C-level timer
    pushed back (every `REARM_S`): a loop that does not run for that long has
    the timer's own thread, which needs no GIL, write every Python thread's
    stack to fd 2. That names what held the loop (a blocking call, a C call
    holding the GIL), which nothing logged after the stall can. The timer is
    the process's one; it is cancelled when this task is."""
    check_dump_after(dump_after_s)
    armed_at = -REARM_S
    try:
        while True:
            t = time.monotonic()
            if dump_after_s > 0 and t - armed_at >= REARM_S:
                armed_at = t
                faulthandler.dump_traceback_later(dump_after_s, file=2)
            await asyncio.sleep(tick_s)  # a measurement tick, not synchronisation
            late = time.monotonic() - t - tick_s
            if late >= stall_s:
                report(late)
    finally:
        if dump_after_s > 0:
            faulthandler.cancel_dump_traceback_later()
