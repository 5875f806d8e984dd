"""Following the leading coordinator replica (docs/reliability.md).

A client (agent link, scheduler client, router) may be given several
coordinator addresses, comma-separated. It dials one; a standby refuses writes
with UNAVAILABLE and names the leader in the trailing metadata `pushkv-leader`
(controlplane/status_map.py); an address that does not answer is UNAVAILABLE
too. `LeaderFollower` decides where to go next: to the named leader, else to
the next address in turn, or stays on a standby that may lead next (below).
With one address it always stays on it, so a single coordinator's clients
behave as before.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

# The same key as controlplane/leadership.py (the coordinator's side).
LEADER_METADATA_KEY = "pushkv-leader"
# A standby that names the leader that just failed this client is likely to
# lead next: the leader is likely dead, and the standby names it until its
# etcd lease expires (about 2 s). The client stays on that standby, retrying
# within STANDBY_RETRY_CAP_S (jittered), for up to STANDBY_WAIT_S after the
# failure (past a lease's expiry and the campaign; the agents' lease at the
# old leader, 5 s by default, is over by then too), then tries the named
# leader again: it may be alive, the failure to reach it transient.
STANDBY_WAIT_S = 5.0
STANDBY_RETRY_CAP_S = 0.5


def addresses(text: str | Sequence[str]) -> list[str]:
    """``"h1:p1, h2:p2"`` (or a list) as ["h1:p1", "h2:p2"]; at least one."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for p in parts:
        a = p.strip()
        if a and a not in out:
            out.append(a)
    if not out:
        raise ValueError(f"no coordinator address in {text!r}")
    return out


def named_leader(exc: BaseException) -> str | None:
    """The leader a standby named in its refusal: "" when it knows none yet,
    None when `exc` is no standby's refusal (an address that did not answer)."""
    trailing = getattr(exc, "trailing_metadata", None)
    if trailing is None:
        return None
    try:
        md: Any = trailing()
    except Exception:
        return None
    for key, value in md or ():
        if key == LEADER_METADATA_KEY:
            return str(value)
    return None


def leader_hint(exc: BaseException) -> str:
    """The leader a standby named in its refusal ("" if none or not a refusal)."""
    return named_leader(exc) or ""


class LeaderFollower:
    """The address to dial now, among a client's coordinator addresses."""

    def __init__(
        self,
        text: str | Sequence[str],
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.addresses = addresses(text)
        self._clock = clock
        self._i = 0
        self._rng = rng or random.Random()
        self.moves = 0
        # The address that last failed without naming a leader (it did not
        # answer, or it was a standby that knew none): "" once one answered.
        self._failed = ""
        # When `_failed` failed (clock), and whether the client now waits at a
        # standby that may lead next (STANDBY_WAIT_S).
        self._failed_at = 0.0
        self._staying = False

    @property
    def current(self) -> str:
        return self.addresses[self._i]

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    def follow(self, exc: BaseException | None = None) -> bool:
        """After a failure on `current`: move to the leader `exc` names, or to
        the next address; or stay, when `current` is a standby that may lead
        next (STANDBY_WAIT_S). True when the move was to a named leader (the
        caller may retry at once, with a short jittered delay)."""
        if not self.several:
            return False
        named = named_leader(exc) if exc is not None else None
        hint = named or ""
        # A live standby naming the leader that just failed, or none (an
        # election under way), after a failure: stay, it may lead next.
        if (
            named in (self._failed, "")
            and self._failed
            and self._clock() - self._failed_at < STANDBY_WAIT_S
        ):
            self._staying = True
            return False
        self._staying = False
        if hint and hint != self.current:
            if hint not in self.addresses:
                self.addresses.append(hint)  # a replica the client was not told of
            self._i = self.addresses.index(hint)
            self.moves += 1
            # At once, unless the named leader is the address that just failed
            # (after STANDBY_WAIT_S at the standby): clients retrying at
            # once would bounce between the two every few milliseconds (a
            # redial storm); the caller's backoff grows instead.
            return hint != self._failed
        self._failed, self._failed_at = self.current, self._clock()
        self._i = (self._i + 1) % len(self.addresses)
        self.moves += 1
        return False

    def reached(self) -> None:
        """`current` answered (a session began): no address has failed since."""
        self._failed = ""
        self._staying = False

    def retry_cap(self, cap_s: float) -> float:
        """The most a caller's backoff may be now: STANDBY_RETRY_CAP_S while it
        stays on a standby that may lead next, else `cap_s`."""
        return min(cap_s, STANDBY_RETRY_CAP_S) if self._staying else cap_s

    def move_to(self, address: str) -> None:
        """Dial `address` next (a leader learned another way, e.g. GetLeadership)."""
        if address not in self.addresses:
            self.addresses.append(address)
        if self.addresses.index(address) != self._i:
            self._i = self.addresses.index(address)
            self.moves += 1

    def delay(self, attempt: int, base_s: float = 0.05, cap_s: float = 1.0) -> float:
        """Jittered exponential backoff: many clients moving at once spread out."""
        step: float = min(self.retry_cap(cap_s), base_s * 2.0 ** min(attempt, 16))
        return step * (0.5 + self._rng.random())


def go_to(named: str, named_term: int, *, dialed: str, answered: bool, term: int) -> str:
    """Where a client whose coordinator `dialed` is silent goes on another
    replica's answer to "who leads?" (GetLeadership: `named` and its
    `named_term`): that leader, or "" to stay (pushkv/net/silence.py, `ask_due`).

    It stays when none is named, or the one dialed is (slow, not gone); on a
    stream the coordinator answered (`answered`, following `term`), also for
    a term no newer than its own: a standby's stale view must not pull a
    client off a live leader. A stream not answered yet has no term to lose.
    """
    if not named or named == dialed:
        return ""
    if answered and named_term <= term:
        return ""
    return named
