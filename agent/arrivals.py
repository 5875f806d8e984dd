"""Decode side: the WRITE notifications each transfer expects, counted per
prefill rank. Owned by the agent's NIXL thread (agent/dataplane.py); plain
Python, no NIXL.

Each transfer is told once: KV_READY when every expected writer's
notification is in, or KV_FAILED when it is resolved otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from agent.events import EventKind
from agent.lru import Lru
from agent.notif import WriteNotif

EXPECT_TTL_S = 600.0


@dataclass(slots=True)
class _Expected:
    since: float
    expected: int = 0
    ranks: set[int] = field(default_factory=set)
    fail_at: float = 0.0  # set after a coordinator restart


# What counting a notification led to: (transfer, the new prefill rank, the
# event to tell the host or None).
Counted = tuple[str, int, EventKind | None]


class Arrivals:
    def __init__(self) -> None:
        self._by_tid: dict[str, _Expected] = {}
        self._told: Lru[None] = Lru()  # transfer ids whose KV_READY/KV_FAILED was emitted

    def __bool__(self) -> bool:
        return bool(self._by_tid)

    def __contains__(self, tid: object) -> bool:
        return tid in self._by_tid

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_tid))

    def counted(self) -> list[tuple[str, tuple[int, ...]]]:
        """Each transfer expected and not told yet, with the ranks counted."""
        return [(tid, tuple(sorted(a.ranks))) for tid, a in self._by_tid.items()]

    def told(self, tid: str) -> bool:
        return tid in self._told

    def expect(self, tid: str, now: float) -> None:
        if tid not in self._told:
            self._by_tid.setdefault(tid, _Expected(now))

    def count(self, n: WriteNotif) -> Counted | None:
        """A notification: None if it changes nothing (told, or a duplicate)."""
        tid = n.transfer_id
        if tid in self._told:
            return None
        a = self._by_tid.get(tid)
        if a is None:
            a = self._by_tid[tid] = _Expected(time.monotonic())
        a.expected = n.expected_writers
        if n.prefill_rank in a.ranks:
            return None
        a.ranks.add(n.prefill_rank)
        if len(a.ranks) >= a.expected:
            self.tell(tid)
            return tid, n.prefill_rank, EventKind.KV_READY
        return tid, n.prefill_rank, None

    def fail_all_at(self, deadline: float) -> None:
        """Fail every transfer still missing ranks at `deadline` (a coordinator restart)."""
        for a in self._by_tid.values():
            a.fail_at = deadline

    def due(self, now: float) -> list[str]:
        """Forget expectations older than EXPECT_TTL_S; return those whose
        fail_at passed (the caller tells them KV_FAILED)."""
        cutoff = now - EXPECT_TTL_S
        for tid in [t for t, a in self._by_tid.items() if a.since < cutoff]:
            del self._by_tid[tid]
        return [t for t, a in self._by_tid.items() if a.fail_at and now >= a.fail_at]

    def tell(self, tid: str) -> None:
        """The transfer is told now: count nothing more for it."""
        self._told.add(tid)
        self._by_tid.pop(tid, None)
