"""The coordinator's side of the timelines (pushkv/rules/timeline.py has the
rules): the waits of its own `Transfer`, and the observers told about every
transfer it changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pushkv.controlplane.transfer import Transfer
from pushkv.rules.timeline import (
    TERMINAL_STAGES,
    WAITS,
    Event,
    Waits,
    first,
    last,
    per_rank,
    sort_by_wait,
    terminal_at,
    waits_of,
)
from pushkv.rules.timeline import created_of as status_created
from pushkv.rules.timeline import events_of as status_events
from pushkv.v1 import pushkv_pb2 as pb

__all__ = [
    "TERMINAL_STAGES",
    "WAITS",
    "Event",
    "Source",
    "TimelineCursor",
    "TransferObserver",
    "Waits",
    "created_of",
    "events_of",
    "first",
    "last",
    "per_rank",
    "sort_by_wait",
    "terminal_at",
    "waits",
]

Source = Transfer | pb.TransferStatus


def events_of(x: Source) -> list[Event]:
    """The timeline as (stage, unix seconds, rank), in recording order."""
    return list(x.timeline) if isinstance(x, Transfer) else status_events(x)


def created_of(x: Source) -> float:
    """Creation time in unix seconds."""
    return x.created_wall if isinstance(x, Transfer) else status_created(x)


def waits(x: Source) -> Waits:
    return waits_of(events_of(x), created_of(x))


# ------------------------------------------------------------------ observers


class TransferObserver(Protocol):
    """Told about every transfer the coordinator changed (metrics, tracing)."""

    def on_transfer_changed(self, t: Transfer) -> None: ...


class TimelineCursor:
    """Hands out each transfer's new timeline events exactly once.

    A transfer's timeline only grows, so a per-transfer count of events seen
    suffices. Cursors of transfers the coordinator forgot are pruned lazily:
    whenever the table doubled since the last prune, `alive` is asked about
    every entry (amortised O(1) per call).
    """

    def __init__(self, alive: Callable[[str], bool], min_prune: int = 4096) -> None:
        self._alive = alive
        # transfer id -> (creation time, events seen); the creation time tells
        # a reused id (a new transfer) from the one it replaced.
        self._seen: dict[str, tuple[float, int]] = {}
        self._min_prune = min_prune
        self._next_prune = min_prune

    def __len__(self) -> int:
        return len(self._seen)

    def new_events(self, t: Transfer) -> tuple[bool, list[Event]]:
        """(first time this transfer is seen, events not handed out before)."""
        prev = self._seen.get(t.transfer_id)
        fresh = prev is None or prev[0] != t.created_mono
        start = 0 if fresh or prev is None else prev[1]
        self._seen[t.transfer_id] = (t.created_mono, len(t.timeline))
        if len(self._seen) >= self._next_prune:
            self.prune()
        return fresh, t.timeline[start:]

    def prune(self) -> list[str]:
        """Forget transfers that are gone; return their ids."""
        gone = [tid for tid in self._seen if not self._alive(tid)]
        for tid in gone:
            del self._seen[tid]
        self._next_prune = max(2 * len(self._seen), self._min_prune)
        return gone
