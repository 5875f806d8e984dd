"""One NodeStream: the agent streams of a node relay's channels (`pushkv relay`).

Each channel is one agent's AgentStream, multiplexed: its first message is the
hello, checked as AgentStream checks it, and then it is an ordinary session of
the runtime. The point is the message count: what the sessions queue while the
stream is busy goes down as one NodeDown, and a relay sends what its agents
queued as one NodeUp, so a TP-8 rendezvous costs the leader a few stream
messages instead of one per rank and report.

Ownership: this object owns `channels` (the reader opens sessions; channels
end in `_flush`). A session's `notify` marks its channel, and one loop
callback per burst (`_drain`) moves every marked session's outbox into the
one `down` queue, which the response generator drains: no task per channel,
so an order costs the leader no task switch of its own. Every session is
closed with its channel (the agent hung up: as a lost AgentStream), and all
of them when the stream ends (the relay is gone, its agents are not known to
be: their transfers wait for the agents' lease,
runtime.AgentSession.link_lost).

A relay may also carry its node's Submits (ChannelUp `submit`, channel 0):
each is applied when read, in stream order, as TransferService.Submit would
apply it for the relay's identity, and answered on the `down` queue. The
fence runs first: a replica that may no longer lead answers UNAVAILABLE, as
its Submit RPC would, and applies nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import structlog

from pushkv.controlplane.auth import Principal
from pushkv.controlplane.errors import PushKVError, ResourceExhausted
from pushkv.controlplane.runtime import AgentSession, Outgoing, Runtime, to_message
from pushkv.controlplane.status_map import outcome
from pushkv.net.batching import MAX_BATCH_BYTES, Batcher
from pushkv.v1 import pushkv_pb2 as pb

log = structlog.get_logger("pushkv.coordinator")

# The most channels open at once on one NodeStream (a node's agent streams).
MAX_CHANNELS = 1024
RPC = "/pushkv.v1.AgentService/NodeStream"
SUBMIT_RPC = "/pushkv.v1.TransferService/Submit"
# A relayed Submit's answer, for the caller's identity (TransferServicer.submit).
Submit = Callable[[Principal, pb.SubmitRequest], pb.SubmitResponse]


def split_batch(
    out: pb.CoordinatorMessage, max_bytes: int = MAX_BATCH_BYTES
) -> list[pb.CoordinatorMessage]:
    """`out`, or, a batch over `max_bytes`, its messages in order as several
    messages of at most about `max_bytes` each (a part of one message goes
    unwrapped). Every order fits the message limit alone (order_size.py), so
    a backlog of large orders never makes a message the agent refuses, which
    would end its stream at every replay."""
    if out.WhichOneof("kind") != "batch" or out.ByteSize() <= max_bytes:
        return [out]
    parts: list[pb.CoordinatorMessage] = []
    part, size = pb.CoordinatorMessage(), 0
    for m in out.batch.messages:
        n = m.ByteSize() + 6  # its tag and length
        if size and size + n > max_bytes:
            parts.append(part)
            part, size = pb.CoordinatorMessage(), 0
        part.batch.messages.append(m)
        size += n
    parts.append(part)
    return [p.batch.messages[0] if len(p.batch.messages) == 1 else p for p in parts]


def outgoing(
    s: AgentSession, msg: Outgoing, welcomed: bool
) -> tuple[list[pb.CoordinatorMessage], bool]:
    """What one item of a session's outbox sends, and whether the session
    ended with it: the welcome (the first item) alone, then what
    `AgentSession.take` batches, split under the byte bound. An AgentStream
    and a NodeStream channel send alike through this. Here, not in
    runtime.py: mypyc compiles that."""
    if not welcomed:
        return [to_message(msg)], False
    out, ended = s.take(msg)
    return split_batch(out), ended


async def session_messages(s: AgentSession) -> AsyncIterator[pb.CoordinatorMessage]:
    """What to send to an agent on its own AgentStream, in order, until its
    session ends."""
    welcomed = False
    while (msg := await s.outbox.get()) is not None:
        parts, ended = outgoing(s, msg, welcomed)
        welcomed = True
        for part in parts:
            yield part
        if ended:
            return


@dataclass(eq=False)
class _Channel:
    session: AgentSession
    welcomed: bool = False  # the welcome went down (alone, first)


class NodeChannels:
    def __init__(
        self,
        rt: Runtime,
        open_agent: Callable[[pb.AgentMessage, Principal, str], AgentSession],
        principal: Principal,
        fence: Callable[[], None],
        submit: Submit,
        peer: str = "",
    ) -> None:
        self._peer = peer  # the relay's address, for the log
        self._submit = submit
        self._rt = rt
        self._open_agent = open_agent
        self._principal = principal
        self._fence = fence
        self._channels: dict[int, _Channel] = {}
        self._ended: set[int] = set()  # channels ended here: their late messages are dropped
        self._down: asyncio.Queue[pb.ChannelDown | None] = asyncio.Queue()
        # Channels whose sessions queued something since the last drain (in order).
        self._dirty: dict[int, None] = {}
        # When the orders moved to `down` were issued (AgentSession.handoff):
        # their residence ends when the NodeDown holding them goes to gRPC.
        self._handoff: list[float] = []

    # ------------------------------------------------------------ up
    def _end(self, channel: int, exc: BaseException | None = None) -> None:
        self._ended.add(channel)
        item = pb.ChannelDown(channel=channel, ended=True)
        if exc is not None:
            code, detail = outcome(exc, RPC)
            item.code, item.detail = code.value[0], detail
        self._down.put_nowait(item)

    def _open(self, channel: int, first: pb.AgentMessage) -> None:
        if len(self._channels) >= MAX_CHANNELS:
            raise ResourceExhausted(f"a NodeStream carries at most {MAX_CHANNELS} channels")
        session = self._open_agent(first, self._principal, self._peer or "relay")
        self._channels[channel] = _Channel(session)
        session.notify = partial(self._mark, channel)
        if session.residence is not None:
            session.handoff = self._handoff
        self._mark(channel)  # its welcome is queued already
        log.info(
            "node_channel_opened",
            engine_id=session.key.engine_id,
            rank=session.key.rank,
            channel=channel,
            peer=self._peer,
        )

    def _on_submit(self, relayed: pb.RelayedSubmit) -> None:
        reply = pb.RelayedSubmitReply(id=relayed.id)
        try:
            self._fence()  # a deposed leader applies nothing
            reply.response.CopyFrom(self._submit(self._principal, relayed.request))
        except Exception as exc:  # the whole Submit fails, as its RPC would
            code, detail = outcome(exc, SUBMIT_RPC)
            reply.code, reply.detail = code.value[0], detail
        self._down.put_nowait(pb.ChannelDown(submitted=reply))

    def _on_item(self, item: pb.ChannelUp) -> None:
        if item.HasField("submit"):
            self._on_submit(item.submit)
            return
        ch = self._channels.get(item.channel)
        if item.closed:
            if ch is not None:
                ch.session.close()  # the drain ends the channel and the session
            return
        if ch is None:
            if item.channel in self._ended:
                return
            try:
                self._open(item.channel, item.message)
            except Exception as exc:  # this channel's refusal, as AgentStream's
                self._end(item.channel, exc)
            return
        try:
            self._rt.on_agent_message(ch.session, item.message)
        except Exception as exc:  # a bad report must not end the channel
            log.warning("agent_message_rejected", agent=str(ch.session.key), error=str(exc))

    async def _read(self, requests: AsyncIterator[pb.NodeUp], broken: list[PushKVError]) -> None:
        try:
            async for up in requests:
                for item in up.items:
                    self._on_item(item)
                if self._dirty:  # what this message queued goes down now, not a callback later
                    self._drain()
        except PushKVError as exc:  # an undecodable message ends the stream with its code
            broken.append(exc)
        finally:
            for ch in self._channels.values():
                ch.session.link_lost = True  # the relay's stream ended, not the agent's
                ch.session.close()
            self._dirty.clear()
            for channel, ch in list(self._channels.items()):
                self._flush(channel, ch)  # what each queued, then its end
            self._down.put_nowait(None)

    # ------------------------------------------------------------ down
    def _mark(self, channel: int) -> None:
        if not self._dirty:  # the first since the last drain: one callback for all
            asyncio.get_running_loop().call_soon(self._drain)
        self._dirty[channel] = None

    def _drain(self) -> None:
        dirty, self._dirty = self._dirty, {}
        for channel in dirty:
            ch = self._channels.get(channel)
            if ch is not None:
                self._flush(channel, ch)

    def _flush(self, channel: int, ch: _Channel) -> None:
        """Move what the channel's session queued into `down`, as its own
        stream would send it (`outgoing`); end the channel with it."""
        s = ch.session
        q = s.outbox
        ended = False
        try:
            while not ended and not q.empty():
                msg = q.get_nowait()
                if msg is None:
                    ended = True
                    break
                parts, ended = outgoing(s, msg, ch.welcomed)
                ch.welcomed = True
                for part in parts:
                    self._down.put_nowait(pb.ChannelDown(channel=channel, message=part))
        except Exception:  # a bug here ends this channel, not the node's stream
            log.exception("node_channel_failed", agent=str(s.key), channel=channel)
            ended = True
        if ended or s.closed:  # closed with a full outbox: its end was not queued
            self._channels.pop(channel, None)
            s.notify = None
            self._rt.close_session(s)
            self._end(channel)

    def _handed_off(self) -> None:
        """The orders moved to `down` go to gRPC now: their residences. (A
        NodeDown at its byte bound may leave some for the next: told a
        message early.)"""
        told = self._rt.order_residence
        now = time.monotonic()
        if told is not None:
            for at in self._handoff:
                told(now - at)
        self._handoff.clear()

    async def serve(self, requests: AsyncIterator[pb.NodeUp]) -> AsyncIterator[pb.NodeDown]:
        log.info("node_stream_opened", peer=self._peer, principal=str(self._principal))
        broken: list[PushKVError] = []
        reader = asyncio.get_running_loop().create_task(self._read(requests, broken))
        batches = Batcher(self._down)
        try:
            self._fence()
            # Accepted: the relay opens its agents' channels now.
            yield pb.NodeDown(takes_submit=True)
            # What the channels queued meanwhile goes as one NodeDown (never waits).
            while (batch := await batches.next()) is not None:
                self._fence()
                if self._handoff:
                    self._handed_off()
                yield pb.NodeDown(items=batch)
            if broken:
                raise broken[0]
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            for ch in list(self._channels.values()):
                ch.session.notify = None
                ch.session.link_lost = True
                self._rt.close_session(ch.session)
            self._channels.clear()
            self._dirty.clear()
            log.info("node_stream_closed", peer=self._peer)
