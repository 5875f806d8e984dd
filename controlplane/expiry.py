"""Time in the rendezvous core: each transfer's deadline, and how long a terminal
transfer stays queryable. Plain Python, no gRPC; Rendezvous.tick drives both."""

from __future__ import annotations

import heapq
from collections import deque

from pushkv.controlplane.domain import TransferId
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.transfer import Transfer


class Deadlines:
    """A heap of (monotonic deadline, version, transfer). Setting a deadline
    pushes a new entry; `Transfer.deadline_version` tells the stale ones apart."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, TransferId]] = []

    def set(self, t: Transfer, seconds: float, now: float) -> None:
        t.deadline_version += 1
        t.deadline_mono = now + seconds
        heapq.heappush(self._heap, (t.deadline_mono, t.deadline_version, t.transfer_id))

    def due(self, now: float, transfers: dict[str, Transfer]) -> list[Transfer]:
        """Pops every deadline passed by `now`: the live transfers still bound by one."""
        heap = self._heap
        out: list[Transfer] = []
        while heap and heap[0][0] <= now:
            _, version, tid = heapq.heappop(heap)
            t = transfers.get(tid)
            if t is None or t.state.terminal or t.deadline_version != version:
                continue
            out.append(t)
        return out

    def earliest(self, transfers: dict[str, Transfer]) -> float | None:
        """The earliest deadline still binding a live transfer. The stale
        entries before it (a transfer ended, or its deadline set again) are
        dropped here: under load there are many, due within milliseconds of
        each other, and each would wake the clock for nothing."""
        heap = self._heap
        while heap:
            deadline, version, tid = heap[0]
            t = transfers.get(tid)
            if t is None or t.state.terminal or t.deadline_version != version:
                heapq.heappop(heap)
                continue
            return deadline
        return None


class Retention:
    """Terminal transfers, oldest first. Each stays `retention_s` (and at most
    `max_terminal` of them), but none is forgotten while a WRITE may land."""

    def __init__(self, settings: CoreSettings) -> None:
        self._settings = settings
        self._terminal: deque[TransferId] = deque()

    def add(self, tid: TransferId) -> None:
        self._terminal.append(tid)

    def sweep(self, transfers: dict[str, Transfer], now: float) -> None:
        """Deletes from `transfers` those whose retention is over."""
        s = self._settings
        terminal = self._terminal
        for _ in range(len(terminal)):
            tid = terminal[0]
            t = transfers.get(tid)
            if t is None:
                terminal.popleft()
                continue
            assert t.terminal_mono is not None
            too_many = len(terminal) > s.max_terminal
            if not too_many and now - t.terminal_mono < s.retention_s:
                break
            terminal.popleft()
            if t.write_may_land:
                terminal.append(tid)  # keep until no WRITE can land
                continue
            del transfers[tid]
