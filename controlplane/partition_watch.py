"""A partition process's side of WatchTransfers (`--partition-procs K`): the
front opens each client's watch at every partition (PartitionUp.watch_open);
here each one is a Watcher on this partition's Runtime, as the RPC's own
(servicers.StatusServicer.WatchTransfers), with one task that sends its
events to the front in PartitionDown frames (controlplane/front_watch.py
merges them).

A watch sends, in order: with include_existing, the matching transfers this
partition holds (oldest first); one message marked `replayed` (always, so the
front knows where the replay ends); then each change as it happens; and last
one marked `ended`, with a code where it failed (a filter refused, a watcher
that fell behind). The Watcher is registered before the replay is read, so
no change between the two is lost. The changes a call made go to the front
ahead of its reply (`flush`), so a client that saw a reply and then changed
another partition's transfer sees the two changes in that order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pushkv.controlplane.errors import ResourceExhausted
from pushkv.controlplane.runtime import Runtime, Watcher
from pushkv.controlplane.servicers import MAX_LIST_LIMIT, watch_filter
from pushkv.controlplane.status_map import outcome
from pushkv.v1 import partition_pb2 as ppb
from pushkv.v1 import pushkv_pb2 as pb

RPC = "/pushkv.v1.StatusService/WatchTransfers"
# Events per PartitionDown: a replay of MAX_LIST_LIMIT transfers goes in
# several frames, each well under pushkv/net/frames.MAX_FRAME.
CHUNK = 256


class PartitionWatches:
    """The front's watches at this partition; owned by the connection's
    server (partition_host.serve_front), which closes them all at its end."""

    def __init__(self, rt: Runtime, send: Callable[[ppb.WatchEvents], None]) -> None:
        self._rt = rt
        self._send = send  # one PartitionDown frame to the front
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._watchers: dict[int, Watcher] = {}

    def open(self, opened: ppb.WatchOpen) -> None:
        wid, request = opened.id, opened.request
        try:
            flt = watch_filter(request)
        except Exception as exc:  # the RPC's own refusal, told to the front
            code, detail = outcome(exc, RPC)
            self._send(ppb.WatchEvents(id=wid, ended=True, code=code.value[0], detail=detail))
            return
        w = self._rt.watch(flt)  # before the replay: no change between the two is lost
        replay: list[pb.TransferEvent] = []
        if request.include_existing:
            found, _ = self._rt.core.find(flt, MAX_LIST_LIMIT)
            replay = [pb.TransferEvent(transfer=self._rt.status(t)) for t in reversed(found)]
        for n in range(0, len(replay), CHUNK):
            self._send(ppb.WatchEvents(id=wid, events=replay[n : n + CHUNK]))
        self._send(ppb.WatchEvents(id=wid, replayed=True))
        task = asyncio.get_running_loop().create_task(self._drain(wid, w), name=f"watch-{wid}")
        self._tasks[wid], self._watchers[wid] = task, w

        def gone(_: object) -> None:
            self._tasks.pop(wid, None)
            self._watchers.pop(wid, None)

        task.add_done_callback(gone)

    def close(self, wid: int) -> None:
        """The front's client went (or its watch ended there): stop sending."""
        task = self._tasks.pop(wid, None)
        if task is not None:
            task.cancel()

    def close_all(self) -> None:
        for wid in list(self._tasks):
            self.close(wid)

    def flush(self) -> None:
        """Send what every watch holds now (before a call's reply goes)."""
        for wid, w in list(self._watchers.items()):
            while not w.queue.empty():
                if self._send_some(wid, w, w.queue.get_nowait()):
                    self.close(wid)  # ended: its task has nothing left to send
                    break

    def _send_some(self, wid: int, w: Watcher, first: pb.TransferEvent | None) -> bool:
        """`first` and what else the queue holds now (at most CHUNK), sent;
        whether the watch ended with them."""
        batch = [first]
        while batch[-1] is not None and len(batch) < CHUNK and not w.queue.empty():
            batch.append(w.queue.get_nowait())
        ended = batch[-1] is None
        out = ppb.WatchEvents(id=wid, events=[e for e in batch if e is not None])
        if ended:
            out.ended = True
            if w.overflowed:
                exc = ResourceExhausted("watcher fell too far behind; re-list and watch")
                code, out.detail = outcome(exc, RPC)
                out.code = code.value[0]
        self._send(out)
        return ended

    async def _drain(self, wid: int, w: Watcher) -> None:
        try:
            while not self._send_some(wid, w, await w.queue.get()):
                pass
        finally:
            self._rt.unwatch(w)


__all__ = ["CHUNK", "PartitionWatches"]
