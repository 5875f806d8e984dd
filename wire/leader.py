"""Following the leading coordinator replica (docs/reliability.md).

A client (agent link, scheduler client, router) may be given several
coordinator addresses, comma-separated. It dials one; a standby refuses writes
with UNAVAILABLE and names the leader in the trailing metadata `pushkv-leader`
(controlplane/status_map.py); an address that does not answer is UNAVAILABLE
too. `LeaderFollower` decides where to go next: to the named leader, else to
the next address in turn. With one address it always stays on it, so a single
coordinator's clients behave as before.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

# The same key as controlplane/leadership.py (the coordinator's side).
LEADER_METADATA_KEY = "pushkv-leader"


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


def leader_hint(exc: BaseException) -> str:
    """The leader a standby named in its refusal ("" if none or not a refusal)."""
    trailing = getattr(exc, "trailing_metadata", None)
    if trailing is None:
        return ""
    try:
        md: Any = trailing()
    except Exception:
        return ""
    for key, value in md or ():
        if key == LEADER_METADATA_KEY:
            return str(value)
    return ""


class LeaderFollower:
    """The address to dial now, among a client's coordinator addresses."""

    def __init__(self, text: str | Sequence[str], rng: random.Random | None = None) -> None:
        self.addresses = addresses(text)
        self._i = 0
        self._rng = rng or random.Random()
        self.moves = 0
        # The address that last failed without naming a leader (it did not
        # answer, or it was a standby that knew none): "" once one answered.
        self._failed = ""

    @property
    def current(self) -> str:
        return self.addresses[self._i]

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    def follow(self, exc: BaseException | None = None) -> bool:
        """After a failure on `current`: move to the leader `exc` names, or to
        the next address. True when the move was to a named leader (the caller
        may retry at once, with a short jittered delay)."""
        if not self.several:
            return False
        hint = leader_hint(exc) if exc is not None else ""
        if hint and hint != self.current:
            if hint not in self.addresses:
                self.addresses.append(hint)  # a replica the client was not told of
            self._i = self.addresses.index(hint)
            self.moves += 1
            # At once, unless the named leader is the address that just failed:
            # a standby names a dead leader until its etcd lease expires, and
            # clients retrying at once would bounce between the two every few
            # milliseconds (a redial storm); the caller's backoff grows instead.
            return hint != self._failed
        self._failed = self.current
        self._i = (self._i + 1) % len(self.addresses)
        self.moves += 1
        return False

    def reached(self) -> None:
        """`current` answered (a session began): no address has failed since."""
        self._failed = ""

    def move_to(self, address: str) -> None:
        """Dial `address` next (a leader learned another way, e.g. GetLeadership)."""
        if address not in self.addresses:
            self.addresses.append(address)
        if self.addresses.index(address) != self._i:
            self._i = self.addresses.index(address)
            self.moves += 1

    def delay(self, attempt: int, base_s: float = 0.05, cap_s: float = 1.0) -> float:
        """Jittered exponential backoff: many clients moving at once spread out."""
        step: float = min(cap_s, base_s * 2.0 ** min(attempt, 16))
        return step * (0.5 + self._rng.random())
