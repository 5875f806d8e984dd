"""WatchTransfers through the front (`--partition-procs K`): a client's watch
is opened at every partition (partition_watch.py), and their events are
merged into its one stream here.

What the client sees is what the RPC sends with one state machine: with
include_existing, the matching transfers held (oldest first, at most
MAX_LIST_LIMIT, the newest of them), then each change as it happens. The
replay is held until every partition has sent its own (each marks its end),
merged by creation time; a partition's changes that come meanwhile follow it.
A client that falls behind by more than a watcher's queue ends with
RESOURCE_EXHAUSTED, as the RPC's own; a partition's failure ends every watch
with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pushkv.controlplane.errors import PushKVError, ResourceExhausted
from pushkv.controlplane.runtime import WATCH_QUEUE_LIMIT
from pushkv.controlplane.servicers import MAX_LIST_LIMIT
from pushkv.controlplane.status_map import error_for
from pushkv.v1 import partition_pb2 as ppb
from pushkv.v1 import pushkv_pb2 as pb

# What a watch may hold for a slow client: its replay, and a watcher's queue.
QUEUE_LIMIT = MAX_LIST_LIMIT + WATCH_QUEUE_LIMIT


class Sender(Protocol):
    def send(self, up: ppb.PartitionUp) -> None: ...


# An item of a watch's queue: an event, the error it ends with, or its end.
Item = pb.TransferEvent | PushKVError | None


@dataclass(eq=False)
class _Watch:
    pending: set[int]  # partitions whose replay has not ended yet
    replays: list[list[pb.TransferEvent]]
    early: list[pb.TransferEvent] = field(default_factory=list)  # changes during the replay
    queue: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    ended: bool = False


class FrontWatches:
    """Owned by the front (front.py), whose partition readers call `on_events`."""

    def __init__(self, links: Sequence[Sender]) -> None:
        self._links = links
        self._ids = itertools.count(1)
        self._watches: dict[int, _Watch] = {}

    async def watch(
        self, request: pb.WatchTransfersRequest, principal: str = ""
    ) -> AsyncGenerator[pb.TransferEvent, None]:
        """The client's stream, until it goes or the watch ends."""
        k = len(self._links)
        wid = next(self._ids)
        w = self._watches[wid] = _Watch(set(range(k)), [[] for _ in range(k)])
        opened = ppb.WatchOpen(id=wid, request=request)
        for link in self._links:
            link.send(ppb.PartitionUp(watch_open=[opened], principal=principal))
        try:
            while True:
                item = await w.queue.get()
                if item is None:
                    return
                if isinstance(item, PushKVError):
                    raise item
                yield item
        finally:
            if self._watches.pop(wid, None) is not None and not w.ended:
                for link in self._links:  # the client went: the partitions stop sending
                    link.send(ppb.PartitionUp(watch_close=[wid]))

    def on_events(self, i: int, got: ppb.WatchEvents) -> None:
        """Partition i's events of a watch (in order)."""
        w = self._watches.get(got.id)
        if w is None or w.ended:
            return
        if i in w.pending:
            w.replays[i].extend(got.events)
            if got.replayed:
                w.pending.discard(i)
                if not w.pending:
                    self._replayed(w)
        elif w.pending:
            w.early.extend(got.events)
        else:
            self._put(got.id, w, got.events)
        if got.ended:
            self._end(got.id, w, error_for(got.code, got.detail) if got.code else None)

    def fail_all(self, exc: PushKVError) -> None:
        """A partition's connection ended: every watch ends with `exc`."""
        for wid, w in list(self._watches.items()):
            self._end(wid, w, exc, tell=False)

    def _replayed(self, w: _Watch) -> None:
        merged = list(heapq.merge(*w.replays, key=lambda e: e.transfer.created_unix_us))
        # As the RPC's replay: the newest MAX_LIST_LIMIT matches, oldest first.
        for e in merged[-MAX_LIST_LIMIT:]:
            w.queue.put_nowait(e)
        for e in w.early:
            w.queue.put_nowait(e)
        w.replays, w.early = [], []

    def _put(self, wid: int, w: _Watch, events: Sequence[pb.TransferEvent]) -> None:
        if w.queue.qsize() + len(events) > QUEUE_LIMIT:
            # A client that cannot keep up is closed, never allowed to grow memory.
            exc = ResourceExhausted("watcher fell too far behind; re-list and watch")
            self._end(wid, w, exc)
            return
        for e in events:
            w.queue.put_nowait(e)

    def _end(self, wid: int, w: _Watch, exc: PushKVError | None, *, tell: bool = True) -> None:
        """The watch ends (after what its queue holds, or at once with an
        error); the partitions still watching are told to stop."""
        if w.ended:
            return
        w.ended = True
        if exc is not None:
            while not w.queue.empty():
                w.queue.get_nowait()
        w.queue.put_nowait(exc)
        if tell:
            for link in self._links:
                link.send(ppb.PartitionUp(watch_close=[wid]))


__all__ = ["QUEUE_LIMIT", "FrontWatches"]
