"""Decode side: the WRITE notifications each transfer expects, counted per
prefill rank. Owned by the agent's NIXL thread (agent/dataplane.py); plain
Python, no NIXL.

Each transfer is told once: KV_READY when every expected writer's
notification is in, or KV_FAILED when it is resolved otherwise.

Transfers told KV_READY are remembered for READY_KEEP_S (at most MAX_READY):
the hello re-sends them as `ready` (pushkv.proto, HeldTransfer.ready), so that
a new leader learns a transfer was written in full before the failover while
the engine's scheduler may still have its registration open.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from pushkv.agent.events import EventKind
from pushkv.agent.lru import Lru
from pushkv.agent.notif import WriteNotif

EXPECT_TTL_S = 600.0
# Long enough to outlast a failover (lease TTL + agents following, seconds)
# and the scheduler settling a load it was told of; bounded in count.
READY_KEEP_S = 30.0
MAX_READY = 4096


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
        # Told KV_READY lately: transfer id -> (monotonic, prefill ranks counted).
        self._ready: OrderedDict[str, tuple[float, tuple[int, ...]]] = OrderedDict()

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
            self.tell(tid, ready=True)
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

    def tell(self, tid: str, ready: bool = False) -> None:
        """The transfer is told now (`ready`: KV_READY): count nothing more for it."""
        self._told.add(tid)
        a = self._by_tid.pop(tid, None)
        if ready:
            self._ready[tid] = (time.monotonic(), tuple(sorted(a.ranks)) if a else ())
            while len(self._ready) > MAX_READY:
                self._ready.popitem(last=False)

    def ready(self, now: float) -> list[tuple[str, tuple[int, ...]]]:
        """Transfers told KV_READY within READY_KEEP_S, with the ranks counted."""
        cutoff = now - READY_KEEP_S
        while self._ready and next(iter(self._ready.values()))[0] < cutoff:
            self._ready.popitem(last=False)
        return [(tid, ranks) for tid, (_, ranks) in self._ready.items()]
