"""The relay's one NodeStream to the leading coordinator, and its channels.

`Upstream.run` owns the stream: it dials the leader (following it as the
agents' link does, pushkv/net/leader.py), sends what the channels queued as one
NodeUp, and routes each ChannelDown to its channel. When the stream ends,
every channel of it ends with the stream's status, so each agent's stream
through the relay ends as a direct stream to that coordinator would, and the
agent reconnects (to the relay) and says hello again: the relay keeps no
agent state across streams.

A generation is one NodeStream; a channel belongs to one generation and its
id is never reused (ids grow across generations), so a late message of an
old channel can never land in a new one.

`Upstream.submit` carries the node scheduler's Submits on the same stream
(channel 0), when the leader said on accepting it that it takes them. Each
waits for its answer on its generation (`pending`); a generation that ends
answers what it still holds UNAVAILABLE, as a broken Submit RPC would (the
calls are idempotent: the scheduler's client sends them again).

A leader that says nothing on a busy stream for a whole lease (the lease its
welcomes give the agents) is taken as gone, as an agent's link takes it
(agent/link.py): a frozen or cut-off process keeps its connection open and
silent. The stream ends UNAVAILABLE, every channel with it, and the relay
dials the next address. With several replicas the relay also asks another
which one leads while the leader is silent (pushkv/net/silence.py, `ask_due`):
named elsewhere (a newer term, once it accepted the stream), it goes there
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from pushkv.net.batching import Batcher
from pushkv.net.leader import LeaderFollower, go_to
from pushkv.net.leader_ask import ask_aio
from pushkv.net.silence import DEFAULT_LIMIT_S, WATCH_S, SilenceWatch
from pushkv.net.tls import TLSFiles, aio_channel
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

log = structlog.get_logger("pushkv.relay")

# Bounds: messages queued for the coordinator, and for one agent.
UP_LIMIT = 100_000
DOWN_LIMIT = 100_000
# A dead coordinator connection is noticed within about keepalive time+timeout.
KEEPALIVE = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)
CODES = {c.value[0]: c for c in grpc.StatusCode}
# A relay redials a quarter as late as an agent at most (agent/link.py: 2 s).
# Relays are one per node, an eighth of the ranks at TP 8, so a failover's
# redials stay below what the agents' own would be, and the relay finds the
# new leader within about this long of its election: its agents' hellos wait
# at the relay for it (Upstream.wait_channel), so they follow just as soon.
RELAY_BACKOFF_MAX_S = 0.5
# An agent's heartbeat waits here up to this long, or until anything else goes
# up, so that a node's heartbeats share a NodeUp: idle, each costs the leader a
# gRPC read and write of its own otherwise. Leases are seconds long (5 s, a
# heartbeat each 1 s), and an agent's own lease runs from the heartbeat's send.
HEARTBEAT_HOLD_S = 0.25
# Relayed Submits waiting for their answers, per stream: more are refused.
MAX_PENDING_SUBMITS = 1024


class CoordinatorSilent(Exception):
    """The leader said nothing on a stream that waited for it for a lease."""


class LeaderElsewhere(Exception):
    """Another replica names another leader than the one dialed, which is
    silent (and, if it accepted the stream, a newer one)."""

    def __init__(self, leader: str) -> None:
        super().__init__(leader)
        self.leader = leader


class RelayError(Exception):
    """A relayed Submit failed: the status its caller is answered with."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


@dataclass(eq=False)
class Channel:
    """One agent stream through the relay."""

    id: int
    gen: Generation
    down: asyncio.Queue[pb.ChannelDown] = field(default_factory=lambda: asyncio.Queue(DOWN_LIMIT))
    closed_up: bool = False
    # The channel's first heartbeat goes at once: an agent welcomed back by
    # the same leader resumes posting only at its ack (agent/link.py).
    beat: bool = False
    welcomed: bool = False  # its welcome went down (its lease was read)

    def send(self, msg: pb.AgentMessage) -> bool:
        """Queue an agent message for the coordinator; False once it cannot go.
        A heartbeat, but the channel's first, waits for company (HEARTBEAT_HOLD_S)."""
        g = self.gen
        if self.closed_up or not g.live:
            return False
        item = pb.ChannelUp(channel=self.id, message=msg)
        if msg.WhichOneof("kind") == "heartbeat":
            if self.beat:
                g.hold(item)
                return True
            self.beat = True
        try:
            g.flush()  # held heartbeats first: each channel's order is kept
            g.up.put_nowait(item)
        except asyncio.QueueFull:
            g.end(self, grpc.StatusCode.UNAVAILABLE, "relay: the coordinator is behind")
            return False
        return True

    def close_up(self) -> None:
        """The agent's stream ended: tell the coordinator (once)."""
        if self.closed_up:
            return
        self.closed_up = True
        self.gen.channels.pop(self.id, None)
        if self.gen.live:
            with contextlib.suppress(asyncio.QueueFull):
                self.gen.up.put_nowait(pb.ChannelUp(channel=self.id, closed=True))


@dataclass(eq=False)
class Generation:
    """One NodeStream and the channels opened on it."""

    address: str
    live: bool = True
    answered: bool = False  # the coordinator sent something on it
    # None ends the request stream (close).
    up: asyncio.Queue[pb.ChannelUp | None] = field(default_factory=lambda: asyncio.Queue(UP_LIMIT))
    channels: dict[int, Channel] = field(default_factory=dict)
    held: list[pb.ChannelUp] = field(default_factory=list)  # heartbeats waiting
    # Said by the leader on accepting the stream: it takes relayed Submits.
    takes_submit: bool = False
    submits: int = 0  # relayed Submits sent on it
    pending: dict[int, asyncio.Future[pb.RelayedSubmitReply]] = field(default_factory=dict)
    _flusher: asyncio.TimerHandle | None = None
    # When the leader last said anything (idle time counts as heard), and
    # the limit its welcomes told (pushkv/net/silence.py).
    silence: SilenceWatch = field(default_factory=SilenceWatch)
    term: int = 0  # the leader's term its welcomes told

    def waits(self) -> bool:
        """Whether the leader owes an answer: to the stream itself, to a
        channel's agent (it heartbeats each interval), or to a Submit."""
        return not self.answered or bool(self.channels) or bool(self.pending)

    def hold(self, item: pb.ChannelUp) -> None:
        """A heartbeat: up with the next message, or HEARTBEAT_HOLD_S after the
        first one held."""
        self.held.append(item)
        if self._flusher is None:
            loop = asyncio.get_running_loop()
            self._flusher = loop.call_later(HEARTBEAT_HOLD_S, self._flush_held)

    def _flush_held(self) -> None:
        self._flusher = None
        if self.live:
            with contextlib.suppress(asyncio.QueueFull):  # a heartbeat may be lost then
                self.flush()

    def flush(self) -> None:
        """Queue the held heartbeats (raises QueueFull as put_nowait)."""
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        held, self.held = self.held, []
        for item in held:
            self.up.put_nowait(item)

    def route(self, item: pb.ChannelDown) -> None:
        if item.HasField("submitted"):
            fut = self.pending.pop(item.submitted.id, None)
            if fut is not None and not fut.done():  # else its caller stopped waiting
                fut.set_result(item.submitted)
            return
        ch = self.channels.get(item.channel)
        if ch is None:
            return  # the agent's stream already ended
        if item.ended:
            del self.channels[item.channel]
            ch.closed_up = True  # the coordinator closed it: nothing more goes up
        elif not ch.welcomed and item.message.WhichOneof("kind") == "welcome":
            ch.welcomed = True
            w = item.message.welcome
            self.silence.told(w.lease_ms, w.heartbeat_interval_ms)
            self.term = max(self.term, w.term)
        try:
            ch.down.put_nowait(item)
        except asyncio.QueueFull:
            self.end(ch, grpc.StatusCode.UNAVAILABLE, "relay: the agent is behind")

    def end(self, ch: Channel, code: grpc.StatusCode, detail: str) -> None:
        """End one channel here, with the status its agent's stream ends with."""
        self.channels.pop(ch.id, None)
        if not ch.closed_up and self.live:
            with contextlib.suppress(asyncio.QueueFull):
                self.up.put_nowait(pb.ChannelUp(channel=ch.id, closed=True))
        ch.closed_up = True
        # The end must reach the agent even behind a full queue: drop what it
        # has not read (its stream ends anyway).
        while ch.down.full():
            ch.down.get_nowait()
        ch.down.put_nowait(
            pb.ChannelDown(channel=ch.id, ended=True, code=code.value[0], detail=detail)
        )

    def close(self, code: grpc.StatusCode, detail: str) -> None:
        """End every channel, then the request stream (`items` returns)."""
        self.live = False
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        self.held.clear()
        for ch in list(self.channels.values()):
            self.end(ch, code, detail)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result(
                    pb.RelayedSubmitReply(
                        code=grpc.StatusCode.UNAVAILABLE.value[0],
                        detail=f"{detail} before the Submit was answered",
                    )
                )
        self.pending.clear()
        while self.up.full():
            self.up.get_nowait()
        self.up.put_nowait(None)

    async def items(self) -> AsyncIterator[pb.NodeUp]:
        """The request stream: what queued since the last send goes as one
        NodeUp (bounded: pushkv/net/batching.py)."""
        batches = Batcher(self.up)
        while (batch := await batches.next()) is not None:
            yield pb.NodeUp(items=batch)


class Upstream:
    def __init__(
        self,
        coordinators: str | Sequence[str],
        tls: TLSFiles | None = None,
        *,
        backoff_min_s: float = 0.05,
        backoff_max_s: float = RELAY_BACKOFF_MAX_S,
        max_message_bytes: int = 4 << 20,
        silence_s: float = DEFAULT_LIMIT_S,  # before any welcome told the lease
        channel_options: tuple[tuple[str, int], ...] = (),
    ) -> None:
        """`channel_options`: more gRPC channel arguments for the NodeStream's
        channel (the cluster bench gives each of the relays it hosts in one
        process a TCP connection of its own, as relays on separate nodes have)."""
        self._follower = LeaderFollower(coordinators)
        self._silence_s = silence_s
        self._tls = tls
        self._options = (
            *KEEPALIVE,
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *channel_options,
        )
        self._backoff = (backoff_min_s, backoff_max_s)
        self._gen: Generation | None = None
        self._next_id = 1
        self._next_submit = 1
        self.streams = 0  # NodeStreams opened (a figure for tests and logs)
        self.up_messages = 0  # NodeUp messages sent
        self.submits = 0  # relayed Submits sent (a figure for tests and logs)
        self.silenced = 0  # streams ended for the leader's silence
        self.redirected = 0  # streams left for the leader another replica named
        self.connected = asyncio.Event()  # set while a stream is answering

    @property
    def address(self) -> str:
        return self._follower.current

    @property
    def addresses(self) -> list[str]:
        return list(self._follower.addresses)

    def open_channel(self) -> Channel | None:
        """A channel on the current stream; None unless the leader accepted one."""
        g = self._gen
        if g is None or not g.live or not g.answered:
            return None
        ch = Channel(self._next_id, g)
        self._next_id += 1
        g.channels[ch.id] = ch
        return ch

    def _accepted_now(self) -> Generation | None:
        g = self._gen
        return g if g is not None and g.live and g.answered else None

    async def _accepted(self, within_s: float) -> Generation | None:
        """The stream once the leader accepted one, waiting up to `within_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while (g := self._accepted_now()) is None:
            left = deadline - loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.connected.wait(), left)
            if self.connected.is_set() and self._accepted_now() is None:
                await asyncio.sleep(0.01)  # the stream just ended; its successor sets it again
        return g

    def no_stream(self, within_s: float) -> str:
        """Why a caller that waited `within_s` for an accepted stream got none."""
        return (
            f"relay: no coordinator accepted its stream within {within_s:g} s "
            f"(dialing {self.address})"
        )

    async def wait_channel(self, within_s: float) -> Channel | None:
        """A channel once the leader accepted a stream, waiting up to `within_s`
        (during a failover an agent's hello waits here, not in its backoff)."""
        if await self._accepted(within_s) is None:
            return None
        return self.open_channel()

    async def submit(self, request: pb.SubmitRequest, within_s: float) -> pb.SubmitResponse:
        """Carry a Submit to the leader on the stream and return its answer,
        waiting up to `within_s` in all; raises RelayError with the status the
        caller gets otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        g = await self._accepted(within_s)
        if g is None:
            raise RelayError(grpc.StatusCode.UNAVAILABLE, self.no_stream(within_s))
        if not g.takes_submit:
            raise RelayError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"relay: the coordinator at {g.address} takes no Submit on a node stream "
                "(an older version): upgrade it, or set the connector's "
                "submit_through_relay to false",
            )
        if len(g.pending) >= MAX_PENDING_SUBMITS:
            raise RelayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"relay: {MAX_PENDING_SUBMITS} Submits already wait for the coordinator",
            )
        sid, self._next_submit = self._next_submit, self._next_submit + 1
        fut: asyncio.Future[pb.RelayedSubmitReply] = loop.create_future()
        g.pending[sid] = fut
        try:
            g.flush()  # held heartbeats first, as for a channel's message
            g.up.put_nowait(pb.ChannelUp(submit=pb.RelayedSubmit(id=sid, request=request)))
        except asyncio.QueueFull:
            g.pending.pop(sid, None)
            raise RelayError(
                grpc.StatusCode.UNAVAILABLE, "relay: the coordinator is behind"
            ) from None
        if not g.submits:
            log.info("submits_carried", coordinator=g.address)
        g.submits += 1
        self.submits += 1
        try:
            reply = await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise RelayError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"relay: the coordinator did not answer a Submit within {within_s:g} s",
            ) from None
        finally:
            g.pending.pop(sid, None)
        if reply.code:
            raise RelayError(CODES.get(reply.code, grpc.StatusCode.UNKNOWN), reply.detail)
        return reply.response

    async def run(self, stop: asyncio.Event) -> None:
        attempt = 0
        while not stop.is_set():
            address = self._follower.current
            answered, err = await self._stream(address, stop)
            if stop.is_set():
                return
            if answered:
                attempt = 0
                self._follower.reached()
            # To a named leader: soon (a short jittered delay); else backing off.
            if isinstance(err, LeaderElsewhere):
                self._follower.move_to(err.leader)
                at_once = True
            else:
                at_once = self._follower.follow(err)
            delay = self._follower.delay(0 if at_once else attempt, *self._backoff)
            attempt += 1
            log.info(
                "coordinator_stream_ended",
                coordinator=address,
                detail=_describe(err),
                next_coordinator=self._follower.current,
                delay_s=round(delay, 2),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    async def _stream(self, address: str, stop: asyncio.Event) -> tuple[bool, BaseException | None]:
        """One NodeStream, until it ends or `stop`: whether the coordinator
        answered on it, and the error that ended it (None: it closed)."""
        gen = Generation(address)
        gen.silence.limit_s = self._silence_s
        channel = aio_channel(address, self._tls, self._options)
        call: Any = pbg.AgentServiceStub(channel).NodeStream(self._count(gen.items()))
        self.streams += 1
        self._gen = gen  # channels open at once; a refusal ends them with its status
        err: BaseException | None = None
        code, detail = grpc.StatusCode.UNAVAILABLE, f"relay: the stream to {address} ended"
        stopper = asyncio.ensure_future(stop.wait())
        reading = asyncio.ensure_future(self._read(call, gen))
        watching = asyncio.ensure_future(self._watch(gen))
        try:
            done, _ = await asyncio.wait(
                (stopper, reading, watching), return_when=asyncio.FIRST_COMPLETED
            )
            for task in (reading, watching):
                if task in done:
                    task.result()  # raises what ended the stream
        except grpc.aio.AioRpcError as exc:
            err, code, detail = exc, exc.code(), exc.details() or detail
        except CoordinatorSilent as exc:
            self.silenced += 1
            log.warning("coordinator_silent", coordinator=address, detail=str(exc))
            err, detail = exc, f"relay: {exc}"
        except LeaderElsewhere as exc:
            self.redirected += 1
            log.warning(
                "leader_elsewhere",
                coordinator=address,
                detail="said nothing" if gen.answered else "not accepted the stream",
                silent_s=round(gen.silence.silent_for(), 1),
                leader=exc.leader,
            )
            err, detail = exc, f"relay: the leader is {exc.leader}"
        except Exception as exc:  # a bug here must not end the relay
            log.exception("coordinator_stream_failed", coordinator=address)
            err = exc
        finally:
            stopper.cancel()
            reading.cancel()
            watching.cancel()
            call.cancel()
            self.connected.clear()
            gen.close(code, detail)
            if self._gen is gen:
                self._gen = None
            await channel.close(None)
        return gen.answered, err

    async def _count(self, items: AsyncIterator[pb.NodeUp]) -> AsyncIterator[pb.NodeUp]:
        async for m in items:
            self.up_messages += 1
            yield m

    async def _watch(self, gen: Generation) -> None:
        """Raise CoordinatorSilent once the leader owed `gen` an answer for a
        whole lease (before any welcome, `silence_s`; before it accepted the
        stream, UNANSWERED_LIMITS times that) and said nothing; with several
        replicas, LeaderElsewhere as soon as another names another leader
        while it is silent (a newer one, once it accepted the stream), asked
        at each step of the silence (pushkv/net/silence.py, `ask_due`)."""
        watch = gen.silence
        watch.started()
        clock = asyncio.get_running_loop().time
        while True:
            before = clock()
            await asyncio.sleep(WATCH_S)  # a timer, not a synchronisation
            # A late wake is this process kept from running: nothing was read
            # meanwhile, so that much silence is not the leader's.
            late = clock() - before - WATCH_S
            if late > WATCH_S:
                watch.excuse(late)
            if not gen.waits():
                watch.heard()  # idle (so already answered): nothing is owed
                continue
            if watch.overdue():
                raise CoordinatorSilent(
                    f"coordinator {gen.address} said nothing for {watch.silent_for():.1f} s "
                    f"(the limit is {watch.limit():g} s): taking it as gone"
                )
            if not self._follower.several or not watch.ask_due():
                continue
            answered = gen.answered
            named, named_term = await ask_aio(
                self._follower.addresses,
                gen.address,
                lambda a: aio_channel(a, self._tls),
            )
            leader = go_to(named, named_term, dialed=gen.address, answered=answered, term=gen.term)
            if leader and gen.answered == answered:  # else stay, or it answered meanwhile
                raise LeaderElsewhere(leader)

    async def _read(self, call: Any, gen: Generation) -> None:
        async for down in call:
            gen.silence.heard()
            if not gen.answered:
                gen.answered = True
                gen.takes_submit = down.takes_submit
                self.connected.set()
            for item in down.items:
                gen.route(item)


def _describe(err: BaseException | None) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return "closed" if err is None else repr(err)
