"""The leading replica's front over K partition processes (step 2 of the
build order in docs/reliability.md, "Past one leader core";
controlplane/partition_host.py is the other end).

A node relay's NodeStream is served here as `NodeChannels` serves it, but the
state lives in the partitions: each channel (one agent's stream) gets a
channel id of its own on every partition's connection, and

- up: its hello, heartbeats and end go to every partition (each keeps its
  own registry copy); each write report and arrival goes to its transfer's
  partition (`partition_of`), a batch split so; a Submit's calls go to their
  transfers' partitions and the answers are put back in the caller's order.
  When the relay's stream ends, every partition is told its channels' carrier
  was lost (`PartitionUp.link_lost`), not that the agents hung up.
- down: what every partition sends an agent, as one stream: the welcome and
  heartbeat acks of partition 0 only (the others' are the same and dropped);
  a peer introduced, or fenced, once; orders, cancels and notices as they
  come. Nothing reaches a channel before partition 0's welcome (what another
  partition sends first waits for it). The first partition to end a channel
  ends it for the relay, and the others are told to close it.

The RPCs go as `PartitionCall`s: a transfer's (BeginTransfer, the unary
sides, Cancel, GetTransfer) to its partition; ListTransfers to all, merged
newest first with every partition's matches counted; ListEngines to all,
partition 0's registry copy with each engine's transfers and each rank's
open orders summed.

Ownership: the front owns the channel, Submit and call id maps and one reader
task per partition; a `FrontStream` owns its relay's `down` queue and its
reader. All of it runs on the replica's event loop. A partition whose
connection ends fails the calls waiting on it and ends every stream (the
replica must resign: `broken`).

The single coordinator serves every RPC through this with `--partition-procs
K` (controlplane/front_servicers.py; agents' own AgentStreams as one-channel
streams), each caller authenticated and named to the partitions, and so do
its front processes (`--fronts F`, controlplane/front_host.py): one
`PartitionFront` each, on a connection of its own to every partition. A
channel's hello carries where its stream comes from (`PartitionUp.via`), so
a partition names a rank's relay whichever front is asked. A replica on etcd
starts its partitions at once and tells them its term when it leads (`lead`,
from its own front only).
`pushkv bench core --procs K` drives this front through a simulated relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog

from pushkv.controlplane.errors import Unavailable
from pushkv.controlplane.front_watch import FrontWatches
from pushkv.controlplane.metric_families import FamilyCopy
from pushkv.controlplane.metrics import Snapshot
from pushkv.controlplane.metrics_merge import merge_snapshots, snapshot_from_json
from pushkv.controlplane.partitions import partition_of
from pushkv.controlplane.servicers import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, MAX_SUBMIT_CALLS
from pushkv.controlplane.status_map import error_for
from pushkv.net.batching import Batcher
from pushkv.v1 import partition_pb2 as ppb
from pushkv.v1 import pushkv_pb2 as pb

log = structlog.get_logger("pushkv.coordinator")

# Agent messages every partition gets: each renews the agent's lease there.
TO_ALL = frozenset({"hello", "heartbeat"})
# What only partition 0's copy of reaches the agent (the others' are the same).
FROM_FIRST = frozenset({"welcome", "heartbeat_ack"})


class Link(Protocol):
    """One partition process's connection (partition_link.PartitionProcess)."""

    def send(self, up: ppb.PartitionUp) -> None: ...
    def downs(self) -> AsyncIterator[ppb.PartitionDown]: ...


def call_transfer_id(call: pb.TransferCall) -> str:
    kind = call.WhichOneof("kind")
    if kind == "register":
        return call.register.transfer_id
    if kind == "prefill_done":
        return call.prefill_done.transfer_id
    if kind == "cancel":
        return call.cancel.transfer_id
    return ""  # an empty call: its partition answers it as an error


def message_transfer_id(msg: pb.AgentMessage, kind: str | None) -> str:
    if kind == "write":
        return msg.write.transfer_id
    if kind == "arrival":
        return msg.arrival.transfer_id
    return ""


@dataclass(eq=False)
class _Channel:
    stream: FrontStream
    local: int  # the relay's channel id
    welcomed: bool = False  # partition 0's welcome went down
    ended: bool = False
    held: list[pb.CoordinatorMessage] = field(default_factory=list)  # before the welcome
    peers: set[tuple[str, int, str]] = field(default_factory=set)
    fenced: set[tuple[str, int, str]] = field(default_factory=set)


@dataclass(eq=False)
class _Submit:
    done: Callable[[pb.RelayedSubmitReply], None]  # told the merged answer once
    relayed_id: int
    results: list[pb.CallResult | None]
    waiting: int  # partitions yet to answer
    term: int = 0
    failed: tuple[int, str] | None = None


class PartitionFront:
    def __init__(self, links: Sequence[Link]) -> None:
        if not links:
            raise ValueError("a front needs at least one partition")
        self._links = list(links)
        self._k = len(links)
        self._channel_ids = itertools.count(1)
        self._submit_ids = itertools.count(1)
        self._channels: dict[int, _Channel] = {}  # the partitions' channel id -> channel
        self._submits: dict[int, tuple[_Submit, list[int]]] = {}  # id -> (Submit, call indices)
        self._call_ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[ppb.PartitionReply]] = {}
        self._waiting: set[asyncio.Future[pb.RelayedSubmitReply]] = set()  # Submit RPCs
        self._readers: list[asyncio.Task[None]] = []
        self.watches = FrontWatches(self._links)  # WatchTransfers streams
        self.broken: list[str] = []  # a partition's connection that ended (the replica resigns)
        self.dead = asyncio.Event()  # set with the first of them
        self.silenced = False  # no message goes to an agent any more (silence)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._readers = [
            loop.create_task(self._read(i), name=f"partition-{i}") for i in range(self._k)
        ]

    async def stop(self) -> None:
        for r in self._readers:
            r.cancel()
        for r in self._readers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await r

    def lead(self, term: int) -> None:
        """This replica leads for `term`: every partition stamps it from now on."""
        for link in self._links:
            link.send(ppb.PartitionUp(lead=term))

    def silence(self) -> None:
        """Send nothing more to any agent, at once (a replica that lost the
        leadership: the process ends next). Every stream ends."""
        self.silenced = True
        streams = {ch.stream for ch in self._channels.values()}
        for s in streams:
            s.lost()

    def stream(self, peer: str = "", principal: str = "") -> FrontStream:
        """A node relay's NodeStream, its caller `principal` (auth.principal_to_wire)."""
        return FrontStream(self, peer, principal=principal)

    # ------------------------------------------------------------ up
    def open_channel(self, stream: FrontStream, local: int, first: pb.AgentMessage) -> int:
        g = next(self._channel_ids)
        self._channels[g] = _Channel(stream, local)
        return g

    def send(self, ups: dict[int, ppb.PartitionUp], principal: str = "") -> None:
        """`ups`, one caller's (`principal`), to their partitions."""
        for i, up in ups.items():
            up.principal = principal
            self._links[i].send(up)

    def route(self, g: int, msg: pb.AgentMessage, ups: dict[int, ppb.PartitionUp]) -> None:
        """One agent message on channel `g`, into the partitions' NodeUps."""
        kind = msg.WhichOneof("kind")
        if kind != "batch":
            if kind in TO_ALL or kind is None:
                for i in range(self._k):
                    _up(ups, i).node.items.add(channel=g, message=msg)
            else:
                i = partition_of(message_transfer_id(msg, kind), self._k)
                _up(ups, i).node.items.add(channel=g, message=msg)
            return
        parts: dict[int, list[pb.AgentMessage]] = {}
        for item in msg.batch.messages:
            k = item.WhichOneof("kind")
            if k in TO_ALL or k is None:
                for i in range(self._k):
                    parts.setdefault(i, []).append(item)
            else:
                parts.setdefault(partition_of(message_transfer_id(item, k), self._k), []).append(
                    item
                )
        for i, items in parts.items():
            one = (
                items[0]
                if len(items) == 1
                else pb.AgentMessage(batch=pb.AgentBatch(messages=items))
            )
            _up(ups, i).node.items.add(channel=g, message=one)

    def submit(
        self,
        done: Callable[[pb.RelayedSubmitReply], None],
        relayed: pb.RelayedSubmit,
        ups: dict[int, ppb.PartitionUp],
    ) -> None:
        """A Submit's calls, each to its transfer's partition; `done` gets the
        answers in the calls' order (or the whole Submit's failure) once."""
        calls = relayed.request.calls
        if len(calls) > MAX_SUBMIT_CALLS:  # as TransferServicer.submit refuses it
            done(
                pb.RelayedSubmitReply(
                    id=relayed.id,
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    detail=f"{len(calls)} calls in one batch (at most {MAX_SUBMIT_CALLS})",
                )
            )
            return
        groups: dict[int, list[int]] = {}
        for n, call in enumerate(calls):
            groups.setdefault(partition_of(call_transfer_id(call), self._k), []).append(n)
        if not groups:
            groups[0] = []  # an empty Submit: a probe of the term
        s = _Submit(done, relayed.id, [None] * len(calls), len(groups))
        for i, idx in groups.items():
            sid = next(self._submit_ids)
            self._submits[sid] = (s, idx)
            request = pb.SubmitRequest(calls=[calls[n] for n in idx])
            _up(ups, i).node.items.add(submit=pb.RelayedSubmit(id=sid, request=request))

    async def submit_rpc(self, request: pb.SubmitRequest, principal: str = "") -> pb.SubmitResponse:
        """The Submit RPC's answer, its calls at their partitions."""
        fut: asyncio.Future[pb.RelayedSubmitReply] = asyncio.get_running_loop().create_future()
        if self.broken:
            raise Unavailable(self.broken[0])
        self._waiting.add(fut)

        def done(reply: pb.RelayedSubmitReply) -> None:
            self._waiting.discard(fut)
            if not fut.done():
                fut.set_result(reply)

        ups: dict[int, ppb.PartitionUp] = {}
        self.submit(done, pb.RelayedSubmit(request=request), ups)
        self.send(ups, principal)
        reply = await fut
        if reply.code:
            raise error_for(reply.code, reply.detail)
        return reply.response

    async def agent_stream(
        self, requests: AsyncIterator[pb.AgentMessage], peer: str = "", principal: str = ""
    ) -> AsyncGenerator[pb.CoordinatorMessage, None]:
        """An agent's own AgentStream, served as a one-channel stream; its end
        is the agent's own (not a lost link). A channel the partitions end
        with a code raises its domain error
        (status_map.error_for)."""

        async def ups() -> AsyncIterator[pb.NodeUp]:
            async for m in requests:
                yield pb.NodeUp(items=[pb.ChannelUp(channel=1, message=m)])

        served = FrontStream(self, peer, own=True, principal=principal).serve(ups())
        async with contextlib.aclosing(served) as downs:
            async for down in downs:
                for item in down.items:
                    if item.ended:
                        if item.code:
                            raise error_for(item.code, item.detail)
                        return
                    if item.HasField("message"):
                        yield item.message

    def close_channels(self, gs: Sequence[int], *, link_lost: bool) -> None:
        """Channels of a stream that ended (`link_lost`: its carrier, not the agent)."""
        if not gs:
            return
        for i in range(self._k):
            up = ppb.PartitionUp()
            if link_lost:
                up.link_lost.extend(gs)
            else:
                for g in gs:
                    up.node.items.add(channel=g, closed=True)
            self._links[i].send(up)
        for g in gs:
            ch = self._channels.pop(g, None)
            if ch is not None:
                ch.ended = True

    # ------------------------------------------------------------ calls
    def call(
        self, i: int, call: ppb.PartitionCall, principal: str = ""
    ) -> asyncio.Future[ppb.PartitionReply]:
        """Send `call`, `principal`'s, to partition i; its reply (a failed
        connection fails it)."""
        call.id = next(self._call_ids)
        fut: asyncio.Future[ppb.PartitionReply] = asyncio.get_running_loop().create_future()
        if self.broken:
            fut.set_exception(Unavailable(self.broken[0]))
            return fut
        self._calls[call.id] = fut
        self._links[i].send(ppb.PartitionUp(calls=[call], principal=principal))
        return fut

    async def transfer_call(
        self, call: ppb.PartitionCall, transfer_id: str, principal: str = ""
    ) -> pb.TransferStatus:
        """A transfer's RPC (begin, a side, cancel, get), at its partition."""
        reply = await self.call(partition_of(transfer_id, self._k), call, principal)
        if reply.code:
            raise error_for(reply.code, reply.detail)
        return reply.transfer

    def watch(
        self, request: pb.WatchTransfersRequest, principal: str = ""
    ) -> AsyncGenerator[pb.TransferEvent, None]:
        """A WatchTransfers stream, its events merged from every partition (front_watch.py)."""
        if self.broken:
            raise Unavailable(self.broken[0])
        return self.watches.watch(request, principal)

    async def list_transfers(self, request: pb.ListTransfersRequest) -> pb.ListTransfersResponse:
        """ListTransfers from every partition: newest first, at most the
        limit a partition applies, the matches counted in all."""
        replies = await asyncio.gather(
            *(self.call(i, ppb.PartitionCall(list=request)) for i in range(self._k))
        )
        out = pb.ListTransfersResponse()
        lists = []
        for r in replies:
            if r.code:
                raise error_for(r.code, r.detail)
            out.total_matching += r.list.total_matching
            lists.append(r.list.transfers)
        limit = min(request.limit or DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
        newest = heapq.merge(*lists, key=lambda t: t.created_unix_us, reverse=True)
        out.transfers.extend(itertools.islice(newest, limit))
        return out

    async def list_engines(self, request: pb.ListEnginesRequest) -> pb.ListEnginesResponse:
        """ListEngines: partition 0's registry copy (they agree), with each
        engine's transfers and each rank's open orders summed over all."""
        replies = await asyncio.gather(
            *(self.call(i, ppb.PartitionCall(engines=request)) for i in range(self._k))
        )
        for r in replies:
            if r.code:
                raise error_for(r.code, r.detail)
        out = pb.ListEnginesResponse()
        out.CopyFrom(replies[0].engines)
        for e in out.engines:
            ranks = {rl.tp_rank: rl for rl in e.ranks}
            for r in replies[1:]:
                for other in r.engines.engines:
                    if other.engine_id != e.engine_id:
                        continue
                    e.inflight_transfers += other.inflight_transfers
                    for orl in other.ranks:
                        mine = ranks.get(orl.tp_rank)
                        if mine is not None and mine.incarnation == orl.incarnation:
                            mine.inflight_orders += orl.inflight_orders
        return out

    async def metrics_snapshot(self, own_events: list[FamilyCopy]) -> Snapshot:
        """Every partition's metrics snapshot, merged (metrics_merge.py), with
        this process's own event series added in."""
        replies = await asyncio.gather(
            *(self.call(i, ppb.PartitionCall(metrics=True)) for i in range(self._k))
        )
        for r in replies:
            if r.code:
                raise error_for(r.code, r.detail)
        return merge_snapshots([snapshot_from_json(r.metrics) for r in replies], own_events)

    # ------------------------------------------------------------ down
    async def _read(self, i: int) -> None:
        try:
            async for down in self._links[i].downs():
                for reply in down.replies:
                    fut = self._calls.pop(reply.id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(reply)
                for got in down.watch:
                    self.watches.on_events(i, got)
                for item in down.node.items:
                    if item.HasField("submitted"):
                        self._on_submitted(item.submitted)
                    elif item.ended:
                        self._on_ended(i, item)
                    elif item.HasField("message"):
                        self._on_message(i, item.channel, item.message)
        finally:
            self.broken.append(f"partition {i}'s connection ended")
            self.dead.set()
            log.error("partition_connection_ended", partition=i)
            for ch in list(self._channels.values()):
                ch.stream.lost()
            waiting: list[asyncio.Future[Any]] = [*self._calls.values(), *self._waiting]
            for w in waiting:  # no partition answers them now
                if not w.done():
                    w.set_exception(Unavailable(self.broken[-1]))
            self._calls.clear()
            self._waiting.clear()
            self.watches.fail_all(Unavailable(self.broken[-1]))

    def _on_submitted(self, r: pb.RelayedSubmitReply) -> None:
        got = self._submits.pop(r.id, None)
        if got is None:
            return
        s, idx = got
        s.waiting -= 1
        if r.code:
            s.failed = s.failed or (r.code, r.detail)
        else:
            s.term = max(s.term, r.response.term)
            for n, res in zip(idx, r.response.results, strict=True):
                s.results[n] = res
        if s.waiting:
            return
        reply = pb.RelayedSubmitReply(id=s.relayed_id)
        if s.failed is not None:
            reply.code, reply.detail = s.failed
        else:
            reply.response.term = s.term
            reply.response.results.extend(r for r in s.results if r is not None)
        s.done(reply)

    def _on_ended(self, i: int, item: pb.ChannelDown) -> None:
        ch = self._channels.pop(item.channel, None)
        if ch is None or ch.ended:
            return
        ch.ended = True
        ch.stream.channel_ended(ch.local)
        ch.stream.put(
            pb.ChannelDown(channel=ch.local, ended=True, code=item.code, detail=item.detail)
        )
        for j in range(self._k):  # the others close it too
            if j != i:
                up = ppb.PartitionUp()
                up.node.items.add(channel=item.channel, closed=True)
                self._links[j].send(up)

    def _on_message(self, i: int, g: int, m: pb.CoordinatorMessage) -> None:
        ch = self._channels.get(g)
        if ch is None or ch.ended:
            return
        batched = m.WhichOneof("kind") == "batch"
        msgs = m.batch.messages if batched else (m,)
        keep = [x for x in msgs if _keep(ch, i, x)]
        if not keep:
            return
        out = (
            keep[0]
            if len(keep) == 1
            else pb.CoordinatorMessage(batch=pb.CoordinatorBatch(messages=keep))
        )
        if not ch.welcomed:
            if not (i == 0 and keep[0].WhichOneof("kind") == "welcome"):
                ch.held.append(out)  # another partition's, before the welcome
                return
            ch.welcomed = True
            ch.stream.put(pb.ChannelDown(channel=ch.local, message=out))
            for held in ch.held:
                ch.stream.put(pb.ChannelDown(channel=ch.local, message=held))
            ch.held.clear()
            return
        ch.stream.put(pb.ChannelDown(channel=ch.local, message=out))


def _keep(ch: _Channel, i: int, m: pb.CoordinatorMessage) -> bool:
    """Whether partition i's message `m` goes to the channel's agent."""
    kind = m.WhichOneof("kind")
    if kind in FROM_FIRST:
        return i == 0
    if kind == "peer":
        ident = m.peer.identity
        key = (ident.engine_id, ident.tp_rank, ident.incarnation)
        if key in ch.peers:
            return False
        ch.peers.add(key)
    elif kind == "peer_fenced":
        key = (m.peer_fenced.engine_id, m.peer_fenced.tp_rank, m.peer_fenced.incarnation)
        if key in ch.fenced:
            return False
        ch.fenced.add(key)
    return True


def _up(ups: dict[int, ppb.PartitionUp], i: int) -> ppb.PartitionUp:
    up = ups.get(i)
    if up is None:
        up = ups[i] = ppb.PartitionUp()
    return up


class FrontStream:
    """One node relay's NodeStream served through the front."""

    def __init__(
        self, front: PartitionFront, peer: str, *, own: bool = False, principal: str = ""
    ) -> None:
        self._front = front
        self._peer = peer
        self._principal = principal  # the caller, named on each PartitionUp it sends
        self._own = own  # an agent's own AgentStream: its end is the agent's
        self.via = "" if own else peer
        self._down: asyncio.Queue[pb.ChannelDown | None] = asyncio.Queue()
        self._channels: dict[int, int] = {}  # the relay's channel id -> the partitions'
        self._ended: set[int] = set()  # channels ended here: their late messages are dropped

    def put(self, item: pb.ChannelDown) -> None:
        self._down.put_nowait(item)

    def _submitted(self, reply: pb.RelayedSubmitReply) -> None:
        self.put(pb.ChannelDown(submitted=reply))

    def channel_ended(self, local: int) -> None:
        g = self._channels.pop(local, None)
        if g is not None:
            self._ended.add(local)

    def lost(self) -> None:
        """A partition's connection ended: this stream ends (the replica resigns)."""
        self._down.put_nowait(None)

    def _on_item(self, item: pb.ChannelUp, ups: dict[int, ppb.PartitionUp]) -> None:
        front = self._front
        if item.HasField("submit"):
            front.submit(self._submitted, item.submit, ups)
            return
        g = self._channels.get(item.channel)
        if item.closed:
            if g is not None:
                for i in range(front._k):
                    _up(ups, i).node.items.add(channel=g, closed=True)
            return
        if g is None:
            if item.channel in self._ended:
                return
            g = self._channels[item.channel] = front.open_channel(self, item.channel, item.message)
            for i in range(front._k):  # the hello (or what stands for it): every partition
                up = _up(ups, i)
                up.node.items.add(channel=g, message=item.message)
                up.via[g] = self.via  # where it comes from, for the partition's ListEngines
            return
        front.route(g, item.message, ups)

    async def _read(self, requests: AsyncIterator[pb.NodeUp]) -> None:
        try:
            async for up in requests:
                ups: dict[int, ppb.PartitionUp] = {}
                for item in up.items:
                    self._on_item(item, ups)
                self._front.send(ups, self._principal)
        finally:
            # A relay's stream ended: its agents are not known to be gone. An
            # agent's own stream ended: the agent's own end.
            gs = list(self._channels.values())
            self._channels.clear()
            self._front.close_channels(gs, link_lost=not self._own)
            self._down.put_nowait(None)

    async def serve(self, requests: AsyncIterator[pb.NodeUp]) -> AsyncGenerator[pb.NodeDown, None]:
        log.info("node_stream_opened", peer=self._peer, front=True)
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        batches = Batcher(self._down)
        try:
            yield pb.NodeDown(takes_submit=True)
            while (batch := await batches.next()) is not None:
                if self._front.silenced:
                    return
                yield pb.NodeDown(items=batch)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            log.info("node_stream_closed", peer=self._peer, front=True)
