"""The silence rule shared by every stream that waits on the coordinator
(docs/reliability.md, "A silent leader is a lost leader").

A frozen or cut-off coordinator keeps its connections open and silent: a
blocked read would wait on it for ever. A stream it answered and then left
silent for a lease (the lease its welcome told, at least two heartbeat
intervals) is taken as gone; one never answered gets UNANSWERED_LIMITS times
that, so a leader busy welcoming a whole cluster after a failover is not left,
and dialed again, by every client at once.

With several replicas the wait is also cut short by asking another replica
which one leads (GetLeadership, `ask_due`): on an answered stream after two
heartbeat intervals of silence (an answer was due in each) and then each
interval, on one not answered yet after each limit. Named elsewhere (and, on an answered stream,
with a newer term than the one followed), the client goes there at once: a
frozen leader is left once a standby has taken over (about the etcd lease),
not a whole agent lease after its last answer; a replica that never answers
a hello (frozen, or on a host that is down) is left for the leader another
names; a slow leader that the others name is waited for. The agent's link
(agent/link.py) and a node relay's NodeStream (pushkv/relay/upstream.py) ask; the
cluster bench's simulated agents use the silence rule alone.
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
# The heartbeat interval before any welcome told one: the coordinator's default.
DEFAULT_HEARTBEAT_S = 1.0


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
        # On an answered stream, asked after two heartbeat intervals of
        # silence (an answer was due in each), then after each interval.
        self.heartbeat_s = DEFAULT_HEARTBEAT_S
        self._clock = clock
        self._heard = clock()
        self._answered = False
        # The watchdog's own: the silence (since `_asked_from`) it last asked in.
        self._asked_from = self._heard
        self._asked = 0

    def started(self) -> None:
        """A new stream: nothing answered on it yet."""
        self._heard, self._answered = self._clock(), False

    def heard(self) -> None:
        """A message came."""
        self._heard, self._answered = self._clock(), True

    def told(self, lease_ms: int, heartbeat_interval_ms: int) -> None:
        """A welcome's lease and heartbeat interval set the limit."""
        self.limit_s = welcome_limit_s(lease_ms, heartbeat_interval_ms) or self.limit_s
        self.heartbeat_s = heartbeat_interval_ms / 1000 or self.heartbeat_s

    def excuse(self, stall_s: float) -> None:
        """The watchdog's own process kept it (and every reader) from running
        for `stall_s`: that much of the silence is not the coordinator's."""
        self._heard = min(self._heard + stall_s, self._clock())

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

    def ask_due(self) -> bool:
        """Whether to ask another replica which one leads now: on an answered
        stream after two heartbeat intervals of silence, then after each
        interval; on one not answered yet after each limit. A message heard
        starts the count again."""
        heard = self._heard
        if heard != self._asked_from:
            self._asked_from, self._asked = heard, 0
        if self._answered:
            due = (self._asked + 2) * self.heartbeat_s
        else:
            due = (self._asked + 1) * self.limit_s
        if self.silent_for() < due:
            return False
        self._asked += 1
        return True
