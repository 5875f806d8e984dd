"""The silence rule shared by every stream that waits on the coordinator
(docs/reliability.md, "A silent leader is a lost leader").

A frozen or cut-off coordinator keeps its connections open and silent: a
blocked read would wait on it for ever. A stream it answered and then left
silent for a lease (the lease its welcome told, at least two heartbeat
intervals) is taken as gone; one never answered gets UNANSWERED_LIMITS times
that, so a leader busy welcoming a whole cluster after a failover is not left,
and dialed again, by every client at once. An agent's link or a relay with
several replicas asks another, after each limit of that wait, which one leads: a
replica that never answers, frozen or on a host that is down, is left as soon
as another names a different leader, and a slow leader that the others name
is waited for. Used by the agent's link
(agent/link.py), a node relay's NodeStream (relay/upstream.py) and the cluster
bench's simulated agents.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# How often a watchdog looks at its streams (the detection's granularity).
WATCH_S = 0.1
# A stream not answered yet gets this many limits.
UNANSWERED_LIMITS = 4
# The limit before any welcome told one: the coordinator's default lease.
DEFAULT_LIMIT_S = 5.0
# How long asking another replica which one leads (GetLeadership) may take.
ASK_S = 1.0


def welcome_limit_s(lease_ms: int, heartbeat_interval_ms: int) -> float:
    """The silence limit a welcome tells (0.0 when it tells neither): the
    lease, and at least two heartbeat intervals (an answer is due each one)."""
    return max(lease_ms, 2 * heartbeat_interval_ms) / 1000


class SilenceWatch:
    """When the coordinator last said anything on the current stream. The
    reading side marks (`started`, `heard`); a watchdog asks `overdue`."""

    def __init__(
        self, limit_s: float = DEFAULT_LIMIT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._heard = clock()
        self._answered = False

    def started(self) -> None:
        """A new stream: nothing answered on it yet."""
        self._heard, self._answered = self._clock(), False

    def heard(self) -> None:
        """A message came."""
        self._heard, self._answered = self._clock(), True

    def told(self, lease_ms: int, heartbeat_interval_ms: int) -> None:
        """A welcome's lease and heartbeat interval set the limit."""
        self.limit_s = welcome_limit_s(lease_ms, heartbeat_interval_ms) or self.limit_s

    def silent_for(self) -> float:
        return self._clock() - self._heard

    @property
    def answered(self) -> bool:
        """Whether anything came on the current stream."""
        return self._answered

    def limit(self) -> float:
        return self.limit_s if self._answered else UNANSWERED_LIMITS * self.limit_s

    def overdue(self) -> bool:
        return self.silent_for() > self.limit()
