"""`pushkv relay`: one per node; the node's agents dial it instead of the coordinator.

It serves AgentStream to the node's agents and carries every such stream as
one channel of its single NodeStream to the leading coordinator
(pushkv/relay/upstream.py). An agent cannot tell: it gets the welcome, orders and
notices it would get directly, and its stream ends with the status it would
end with. What changes is the leader's load: a node's ranks share one
stream, so their reports and orders travel together. The node's scheduler
may send its Submits here too (TransferService.Submit, the only call of that
service a relay serves): they go up the same stream, not as RPCs of their own.

The relay keeps no transfer state. It is a process of its own (not a thread
of some worker) so that every rank of the node, in whatever process, reaches
it; it listens on loopback or a Unix socket, and dials the coordinator with
the node's TLS identity when one is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from pushkv.net.event_loop import event_loop_name, report_stalls
from pushkv.net.port_file import write_port_file
from pushkv.net.tls import TLSFiles, server_ping_options
from pushkv.relay.upstream import CODES, Channel, RelayError, Upstream
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

log = structlog.get_logger("pushkv.relay")

HELLO_TIMEOUT_S = 10.0  # as the coordinator's AgentStream
STOP_WAIT_S = 5.0  # for the upstream to end its stream on stop
# NodeUp{items: [ChannelUp{channel, message}]} around one agent message: three
# tags, three lengths and a channel id, well under this.
ENVELOPE_BYTES = 64
SERVICE = "pushkv.v1.AgentService"
# A relayed Submit waits at most this long in all (or its caller's deadline).
SUBMIT_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class RelaySettings:
    # The coordinator replicas, comma-separated (followed to the leader).
    coordinators: str | Sequence[str]
    # Where the node's agents dial: HOST:PORT (loopback) or unix:PATH.
    listen: str = "127.0.0.1:50161"
    # TLS to the coordinator: the node's identity (engine:<id>, docs/operations.md).
    tls: TLSFiles = field(default_factory=TLSFiles)
    port_file: str = ""
    max_message_bytes: int = 4 << 20
    # How long an agent's hello waits for a stream the leader accepted.
    hello_wait_s: float = 10.0


class RelayServicer(pbg.AgentServiceServicer):
    def __init__(self, upstream: Upstream, hello_wait_s: float, max_message_bytes: int) -> None:
        self._up = upstream
        self._wait_s = hello_wait_s
        # What a NodeUp may carry of one agent message: the coordinator would
        # end the whole NodeStream (every channel of the node) on a bigger one.
        self._max_item = max_message_bytes - ENVELOPE_BYTES

    def _too_big(self, msg: pb.AgentMessage) -> str:
        """Why `msg` cannot go up ("" if it can)."""
        n = msg.ByteSize()
        if n <= self._max_item:
            return ""
        return (
            f"relay: an agent message of {n} bytes does not fit the node stream "
            f"({self._max_item} bytes at most, the coordinator's limit less the envelope)"
        )

    async def AgentStream(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        try:
            first = await asyncio.wait_for(anext(request_iterator), HELLO_TIMEOUT_S)
        except (StopAsyncIteration, TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be hello")
        # Held (the agent's next messages wait in gRPC's flow control) until
        # the leader accepts the relay's stream: after a failover the agent is
        # welcomed as soon as the relay reaches the new leader.
        ch = await self._up.wait_channel(self._wait_s)
        if ch is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                self._up.no_stream(self._wait_s),
            )
        assert ch is not None
        if why := self._too_big(first):
            ch.close_up()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        ch.send(first)
        who = _agent_fields(first)
        log.info("agent_relayed", **who)
        reader = asyncio.get_running_loop().create_task(self._forward(request_iterator, ch))
        try:
            while True:
                item = await ch.down.get()
                if item.ended:
                    if item.code:
                        code = CODES.get(item.code, grpc.StatusCode.UNKNOWN)
                        log.warning("agent_stream_ended", code=code.name, detail=item.detail, **who)
                        await context.abort(code, item.detail)
                    return
                yield item.message
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            ch.close_up()

    async def NodeStream(
        self, request_iterator: AsyncIterator[pb.NodeUp], context: Any
    ) -> AsyncIterator[pb.NodeDown]:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "a relay carries agents, not relays",
        )
        yield pb.NodeDown()  # never reached: abort raises

    async def _forward(self, requests: AsyncIterator[pb.AgentMessage], ch: Channel) -> None:
        try:
            async for msg in requests:
                if why := self._too_big(msg):  # this agent's stream ends, not the node's
                    ch.gen.end(ch, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
                    return
                if not ch.send(msg):
                    return
        finally:
            ch.close_up()


class RelayTransferServicer(pbg.TransferServiceServicer):
    """Submit only: carried to the leader on the node's stream (pushkv/relay/upstream.py).
    The unary calls answer UNIMPLEMENTED, naming what does serve them."""

    def __init__(self, upstream: Upstream, max_message_bytes: int) -> None:
        self._up = upstream
        self._max_item = max_message_bytes - ENVELOPE_BYTES

    async def Submit(self, request: pb.SubmitRequest, context: Any) -> pb.SubmitResponse:
        n = request.ByteSize()
        if n > self._max_item:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"relay: a Submit of {n} bytes does not fit the node stream "
                f"({self._max_item} bytes at most)",
            )
        left = context.time_remaining()
        within = SUBMIT_WAIT_S if left is None else min(max(left, 0.0), SUBMIT_WAIT_S)
        try:
            return await self._up.submit(request, within)
        except RelayError as exc:
            await context.abort(exc.code, exc.detail)
            raise  # not reached: abort raises

    async def _unary(self, context: Any) -> pb.TransferStatus:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"a relay carries Submit only: send this call to the coordinator ({self._up.address})",
        )
        return pb.TransferStatus()  # not reached: abort raises

    async def BeginTransfer(self, request: Any, context: Any) -> pb.TransferStatus:
        return await self._unary(context)

    async def RegisterDecodeBlocks(self, request: Any, context: Any) -> pb.TransferStatus:
        return await self._unary(context)

    async def ReportPrefillDone(self, request: Any, context: Any) -> pb.TransferStatus:
        return await self._unary(context)

    async def Cancel(self, request: Any, context: Any) -> pb.TransferStatus:
        return await self._unary(context)


async def _track_health(up: Upstream, hs: HealthServicer, stop: asyncio.Event) -> None:
    """SERVING while the coordinator answers on the stream (probes and `grpcurl`)."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    while not stop.is_set():
        await hs.set(SERVICE, serving if up.connected.is_set() else not_serving)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


class Relay:
    """A running relay: its local server, its upstream and their tasks (owned here)."""

    def __init__(self, settings: RelaySettings) -> None:
        if settings.tls.enabled or settings.tls.key:
            settings.tls.material()  # names a missing or mismatched file
        self.settings = settings
        self.upstream = Upstream(
            settings.coordinators, settings.tls, max_message_bytes=settings.max_message_bytes
        )
        self.port = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Future[None]] = []
        self._stalls: asyncio.Future[None] | None = None  # logs a stalled event loop
        opts = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            *server_ping_options(),
            # Its clients are this node's own ranks: no ping of theirs ends
            # their streams (gRPC's BDP pings have drawn "too_many_pings"
            # from servers at their defaults, grpc/grpc-java#5188).
            ("grpc.http2.max_ping_strikes", 0),
        ]
        self._server = grpc.aio.server(options=opts)
        pbg.add_AgentServiceServicer_to_server(
            RelayServicer(self.upstream, settings.hello_wait_s, settings.max_message_bytes),
            self._server,
        )
        pbg.add_TransferServiceServicer_to_server(
            RelayTransferServicer(self.upstream, settings.max_message_bytes), self._server
        )
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)

    @property
    def address(self) -> str:
        listen = self.settings.listen
        return listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{self.port}"

    async def start(self) -> Relay:
        self.port = self._server.add_insecure_port(self.settings.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.settings.listen}")
        await self._server.start()
        self._tasks = [
            asyncio.ensure_future(self.upstream.run(self._stop)),
            asyncio.ensure_future(_track_health(self.upstream, self._health, self._stop)),
        ]
        self._stalls = asyncio.ensure_future(report_stalls(_log_stall))
        log.info(
            "relay_listening",
            address=self.address,
            coordinators=",".join(self.upstream.addresses),
            event_loop=event_loop_name(),
        )
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._stalls is not None:
            self._stalls.cancel()
            await asyncio.gather(self._stalls, return_exceptions=True)
        # The upstream first: its stream ends with the channels still open, so
        # the leader takes the agents as cut off (their transfers wait for the
        # agents' lease, for a relay that comes back), not as gone, which a
        # channel closed by an agent's handler would say.
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
            for t in pending:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.stop(1.0)


def _agent_fields(hello: pb.AgentMessage) -> dict[str, str | int]:
    """engine_id and rank of the agent whose first message this is, for its
    log lines (the coordinator's keys; rank as the coordinator numbers it)."""
    ident = hello.hello.identity
    return {
        "engine_id": ident.engine_id,
        "rank": ident.pp_rank * max(1, ident.tp_size) + ident.tp_rank,
    }


def _log_stall(seconds: float) -> None:
    log.warning(
        "event_loop_stalled",
        seconds=round(seconds, 1),
        detail="this process did not run its event loop (its host paused, its cores "
        "oversubscribed, or a call blocked the loop): its agents and the leader heard "
        "nothing through it meanwhile",
    )


async def serve(settings: RelaySettings) -> int:
    """Run until SIGTERM/SIGINT; the exit status."""
    relay = await Relay(settings).start()
    if settings.port_file:
        write_port_file(settings.port_file, relay.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await relay.stop()
    return 0
