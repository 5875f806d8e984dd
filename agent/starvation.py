"""Whether the host process lets the agent's threads run.

An agent lives inside a vLLM worker. When that process keeps its threads from
running (its cores oversubscribed, or a C call holding the GIL), the agent
sends no heartbeat, its lease lapses and the orders it holds are dropped: the
right outcome, and one that looks like a silent coordinator unless the agent
says why. The link's watchdog wakes every `WATCH_S`; `StarvationWatch.tick`
measures how late each wake came, so a starved process is named as such in
the log (`STARVED_S` late or more), with the longest stall kept as a figure.

With a hang dump asked for (the connector's `hang_dump_s`, seconds > 0), the
watchdog also keeps faulthandler's C-level timer armed: if the watchdog does
not run for that long, the timer's own thread (which needs no GIL) writes
every Python thread's stack to stderr, the engine's log. That says what held
the process, which nothing written after the stall can. It is process-wide
(one timer per process), and each push back (once a second) cancels the
last timer and waits, holding the GIL, for its thread to end: on a starved
core that wait is a short stall of its own. So it is off unless asked for
(the test harness asks with PUSHKV_TEST_HANG_DUMP_S set).
"""

from __future__ import annotations

import faulthandler
import time
from collections.abc import Callable

from pushkv.net.event_loop import MAX_DUMP_AFTER_S, REARM_S, check_dump_after

# A watchdog wake at least this late names the process as starving the agent.
STARVED_S = 2.0


class StarvationWatch:
    """Owned by one watchdog thread, which calls `tick` once per period."""

    def __init__(
        self,
        period_s: float,
        *,
        dump_after_s: float = 0.0,
        starved_s: float = STARVED_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._period_s = period_s
        self._starved_s = starved_s
        self._dump_after_s = check_dump_after(dump_after_s)
        self._clock = clock
        self._last = clock()
        self._armed_at = -REARM_S
        self.stalls = 0  # wakes at least `starved_s` late
        self.longest_s = 0.0  # the longest stall seen

    def tick(self) -> float:
        """One watchdog wake: returns how late it came when that counts as a
        stall (>= `starved_s`), else 0.0."""
        now = self._clock()
        late = now - self._last - self._period_s
        self._last = now
        if self._dump_after_s > 0 and now - self._armed_at >= REARM_S:
            self._armed_at = now
            # fd 2, not sys.stderr: vLLM may replace the object, not the fd.
            faulthandler.dump_traceback_later(self._dump_after_s, file=2)
        if late < self._starved_s:
            return 0.0
        self.stalls += 1
        self.longest_s = max(self.longest_s, late)
        return late

    def stepped(self) -> None:
        """The watchdog's step is over: the next wait starts now (a step may
        block, asking another replica who leads, without that being a stall)."""
        self._last = self._clock()

    def close(self) -> None:
        if self._dump_after_s > 0:
            faulthandler.cancel_dump_traceback_later()


__all__ = ["MAX_DUMP_AFTER_S", "STARVED_S", "StarvationWatch", "check_dump_after"]
