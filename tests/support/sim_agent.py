"""Simulated coordinator agents over real gRPC, and a coordinator on its own thread.

`SimAgent` speaks the agent protocol on `AgentService.AgentStream` exactly as a
real agent would (hello -> Welcome -> orders/notices down, reports up) but
moves no bytes.  Everything it receives lands in `inbox`; tests wait on it with
deadlines via `expect`.  `SimCluster` starts the ranks of one prefill and one
decode engine and, with ``auto_complete``, answers every order: the prefill
rank reports POSTED + DONE and the decode rank it wrote into reports arrival.
With ``batching`` an agent says ``accepts_batches`` in its hello, sends its
auto-completion reports as one ``AgentBatch``, and unpacks ``CoordinatorBatch``
into `inbox` (`batches_seen` counts them). A clean COMPLETE sends no notice:
wait for it with `wait_terminal`.

`ThreadedCoordinator` runs a coordinator on a private event loop in a daemon
thread, for tests that use the blocking grpc API (fuzzing, reflection).
"""

# The helpers take `timeout` like the asyncio APIs they wrap.
# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from pushkv.controlplane.server import Coordinator, ServerSettings, start
from pushkv.controlplane.settings import CoreSettings
from pushkv.protocol import PROTOCOL_VERSION
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

T = TypeVar("T")

TOKENS_PER_BLOCK = 16
NUM_BLOCKS = 1024
BLOCK_LEN = 4096
DEFAULT_TIMEOUT = 5.0

ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}


def layout(
    rank: int = 0,
    *,
    tokens_per_block: int = TOKENS_PER_BLOCK,
    num_blocks: int = NUM_BLOCKS,
    block_len: int = BLOCK_LEN,
    compat_hash: str = "",
) -> pb.KVLayout:
    """Two regions (K and V of one layer) of one KV group."""
    base = 0x10_0000_0000 * (rank + 1)
    size = block_len * num_blocks
    return pb.KVLayout(
        tokens_per_block=tokens_per_block,
        regions=[
            pb.KVRegion(base_addr=base, block_len=block_len, num_blocks=num_blocks, name="k"),
            pb.KVRegion(
                base_addr=base + size, block_len=block_len, num_blocks=num_blocks, name="v"
            ),
        ],
        memory_kind="DRAM",
        compat_hash=compat_hash,
    )


def hello(
    engine_id: str,
    role: str | int,
    rank: int = 0,
    tp_size: int = 1,
    incarnation: str = "i1",
    *,
    protocol_version: int = PROTOCOL_VERSION,
    nixl_metadata: bytes | None = None,
    kv_layout: pb.KVLayout | None = None,
) -> pb.AgentMessage:
    role_pb = ROLES[role] if isinstance(role, str) else pb.Role.ValueType(role)
    return pb.AgentMessage(
        hello=pb.AgentHello(
            protocol_version=protocol_version,
            identity=pb.AgentIdentity(
                engine_id=engine_id,
                role=role_pb,
                tp_rank=rank,
                tp_size=tp_size,
                incarnation=incarnation,
            ),
            nixl_agent_name=f"{engine_id}-{rank}-{incarnation}",
            nixl_metadata=(
                nixl_metadata
                if nixl_metadata is not None
                else f"md:{engine_id}/{rank}@{incarnation}".encode()
            ),
            layout=kv_layout if kv_layout is not None else layout(rank),
        )
    )


# A connector's on_transfer_failure as its hello publishes it ("": not stated).
POLICIES = {
    "": pb.ON_TRANSFER_FAILURE_UNSPECIFIED,
    "recompute": pb.ON_TRANSFER_FAILURE_RECOMPUTE,
    "fail": pb.ON_TRANSFER_FAILURE_FAIL,
}


def serving(msg: pb.AgentMessage, api_url: str, policy: str = "") -> pb.AgentMessage:
    """`msg` (a hello) as a vLLM engine's agent sends it: routable, behind
    `api_url`, publishing its on_transfer_failure."""
    msg.hello.api_url = api_url
    msg.hello.routable = True
    msg.hello.on_transfer_failure = POLICIES[policy]
    return msg


def blocks(*groups: Sequence[int]) -> list[pb.BlockIds]:
    return [pb.BlockIds(ids=list(g)) for g in groups]


def write_report(
    order: pb.TransferOrder, status: int, detail: str = "", nbytes: int = 0
) -> pb.AgentMessage:
    return pb.AgentMessage(
        write=pb.WriteReport(
            order_id=order.order_id,
            transfer_id=order.transfer_id,
            status=status,  # type: ignore[arg-type]
            detail=detail,
            bytes=nbytes,
        )
    )


class StreamEnded(AssertionError):
    """The agent stream ended while a test waited for a message."""


class SimAgent:
    """One simulated agent rank with a live AgentStream."""

    def __init__(
        self,
        address: str,
        engine_id: str,
        role: str | int,
        rank: int = 0,
        tp_size: int = 1,
        incarnation: str = "i1",
        *,
        auto_complete: bool = False,
        heartbeat_interval: float | None = None,
        nixl_metadata: bytes | None = None,
        kv_layout: pb.KVLayout | None = None,
        batching: bool = False,
    ) -> None:
        self.address = address
        self.engine_id = engine_id
        self.role = ROLES[role] if isinstance(role, str) else role
        self.rank = rank
        self.tp_size = tp_size
        self.incarnation = incarnation
        self.auto_complete = auto_complete
        self.heartbeat_interval = heartbeat_interval
        self.hello = hello(
            engine_id,
            self.role,
            rank,
            tp_size,
            incarnation,
            nixl_metadata=nixl_metadata,
            kv_layout=kv_layout,
        )
        self.batching = batching
        self.hello.hello.accepts_batches = batching
        self.batches_seen = 0  # CoordinatorMessage.batch received (unpacked into inbox)
        # Every message received, in order; None once the stream ended.
        self.inbox: asyncio.Queue[pb.CoordinatorMessage | None] = asyncio.Queue()
        self.acks: asyncio.Queue[pb.HeartbeatAck] = asyncio.Queue()
        self.orders_seen: list[pb.TransferOrder] = []
        # With auto_complete on a prefill rank: decode ranks that report arrival.
        self.arrival_peers: dict[tuple[str, int], SimAgent] = {}
        self.welcome: pb.Welcome | None = None
        self.ended = asyncio.Event()
        self.code: grpc.StatusCode | None = None
        self.details: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._beater: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._seq = itertools.count(1)

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine_id, self.rank)

    # ------------------------------------------------------------ lifecycle
    async def start(self, timeout: float = DEFAULT_TIMEOUT) -> pb.Welcome:
        """Open the stream, send hello and wait for Welcome."""
        self._channel = grpc.aio.insecure_channel(self.address)
        self._call = pbg.AgentServiceStub(self._channel).AgentStream(None)
        await self._call.write(self.hello)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self.welcome = await self.expect("welcome", timeout)
        if self.heartbeat_interval:
            self._beater = asyncio.get_running_loop().create_task(self._beat())
        return self.welcome

    async def close(self, *, graceful: bool = False, timeout: float = DEFAULT_TIMEOUT) -> None:
        """End the stream: half-close and wait for the server (graceful) or cancel it."""
        if self._beater is not None:
            self._beater.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beater
        if self._call is not None:
            if graceful and not self.ended.is_set():
                with contextlib.suppress(Exception):
                    await self._call.done_writing()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ended.wait(), timeout)
            self._call.cancel()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    async def __aenter__(self) -> SimAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ receiving
    async def _read(self) -> None:
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs lacks aio.EOF
                    break
                if msg.WhichOneof("kind") == "batch":
                    self.batches_seen += 1
                    items = list(msg.batch.messages)
                else:
                    items = [msg]
                for item in items:
                    await self._received(item)
            self.code = await self._call.code()
            self.details = await self._call.details()
        except grpc.aio.AioRpcError as exc:
            self.code, self.details = exc.code(), exc.details()
        except asyncio.CancelledError:
            self.code = grpc.StatusCode.CANCELLED
        finally:
            self.ended.set()
            self.inbox.put_nowait(None)

    async def _received(self, msg: pb.CoordinatorMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "heartbeat_ack":
            self.acks.put_nowait(msg.heartbeat_ack)
        self.inbox.put_nowait(msg)
        if kind == "order":
            self.orders_seen.append(msg.order)
            if self.auto_complete:
                await self._complete(msg.order)

    async def _complete(self, order: pb.TransferOrder) -> None:
        if self.batching:
            await self.send_batch(
                [
                    write_report(order, pb.WRITE_STATUS_POSTED),
                    write_report(order, pb.WRITE_STATUS_DONE),
                ]
            )
        else:
            await self.report_write(order, pb.WRITE_STATUS_POSTED)
            await self.report_write(order, pb.WRITE_STATUS_DONE)
        for tgt in order.targets:
            peer = self.arrival_peers.get((tgt.decode_engine_id, tgt.decode_rank))
            if peer is not None:
                await peer.report_arrival(order.transfer_id, [order.prefill_rank])

    async def next(self, timeout: float = DEFAULT_TIMEOUT) -> pb.CoordinatorMessage:
        """The next message other than a heartbeat ack."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                msg = await asyncio.wait_for(self.inbox.get(), max(deadline - loop.time(), 0))
            except TimeoutError:
                raise AssertionError(f"{self.key}: nothing received within {timeout}s") from None
            if msg is None:
                self.inbox.put_nowait(None)  # stay ended for later readers
                raise StreamEnded(f"{self.key}: stream ended ({self.code}: {self.details})")
            if msg.WhichOneof("kind") != "heartbeat_ack":
                return msg

    async def expect(
        self, kind: str, timeout: float = DEFAULT_TIMEOUT, *, skip: Sequence[str] = ()
    ) -> Any:
        """The next message of oneof `kind` (its inner message).

        Heartbeat acks and kinds in `skip` are passed over; any other kind fails.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            msg = await self.next(max(deadline - loop.time(), 0))
            got = msg.WhichOneof("kind")
            if got == kind:
                return getattr(msg, kind)
            if got not in skip:
                raise AssertionError(f"{self.key}: expected {kind}, got {got}: {msg}")

    async def expect_end(self, timeout: float = DEFAULT_TIMEOUT) -> grpc.StatusCode | None:
        """Wait for the server to end the stream; return its status code."""
        await asyncio.wait_for(self.ended.wait(), timeout)
        return self.code

    # ------------------------------------------------------------ sending
    async def send(self, msg: pb.AgentMessage) -> None:
        async with self._write_lock:
            await self._call.write(msg)

    async def send_batch(self, msgs: Sequence[pb.AgentMessage]) -> None:
        await self.send(pb.AgentMessage(batch=pb.AgentBatch(messages=msgs)))

    async def report_write(
        self, order: pb.TransferOrder, status: int, detail: str = "", nbytes: int = 0
    ) -> None:
        await self.send(write_report(order, status, detail, nbytes))

    async def report_arrival(self, transfer_id: str, ranks: Sequence[int]) -> None:
        await self.send(
            pb.AgentMessage(
                arrival=pb.ArrivalReport(transfer_id=transfer_id, prefill_ranks=list(ranks))
            )
        )

    async def heartbeat(
        self, *, wait_ack: bool = True, timeout: float = DEFAULT_TIMEOUT
    ) -> pb.HeartbeatAck | None:
        """Send a heartbeat; with wait_ack, return the ack that echoes its seq."""
        seq = next(self._seq)
        await self.send(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq)))
        if not wait_ack:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            ack = await asyncio.wait_for(self.acks.get(), max(deadline - loop.time(), 0))
            if ack.seq == seq:
                return ack

    async def _beat(self) -> None:
        assert self.heartbeat_interval
        while not self.ended.is_set():
            # A period, not synchronisation: keeps the lease alive like a real agent.
            await asyncio.sleep(self.heartbeat_interval)
            with contextlib.suppress(Exception):
                await self.heartbeat(wait_ack=False)


class SimCluster:
    """All ranks of one prefill and one decode engine (equal TP)."""

    def __init__(
        self,
        address: str,
        prefill_engine: str = "p0",
        decode_engine: str = "d0",
        tp_size: int = 1,
        incarnation: str = "i1",
        *,
        auto_complete: bool = True,
        heartbeat_interval: float | None = None,
        batching: bool = False,
    ) -> None:
        common: dict[str, Any] = {"incarnation": incarnation}
        common["heartbeat_interval"] = heartbeat_interval
        common["batching"] = batching
        self.prefill = [
            SimAgent(
                address,
                prefill_engine,
                "prefill",
                r,
                tp_size,
                auto_complete=auto_complete,
                **common,
            )
            for r in range(tp_size)
        ]
        self.decode = [
            SimAgent(address, decode_engine, "decode", r, tp_size, **common) for r in range(tp_size)
        ]
        peers = {d.key: d for d in self.decode}
        for p in self.prefill:
            p.arrival_peers = peers

    @property
    def agents(self) -> list[SimAgent]:
        return [*self.prefill, *self.decode]

    async def start(self) -> None:
        await asyncio.gather(*(a.start() for a in self.agents))

    async def close(self) -> None:
        await asyncio.gather(*(a.close() for a in self.agents))

    async def __aenter__(self) -> SimCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def rendezvous(
    channel: grpc.aio.Channel,
    transfer_id: str,
    *,
    prefill_engine: str = "p0",
    decode_engine: str = "d0",
    decode_first: bool = True,
    num_tokens: int = 40,
) -> pb.TransferStatus:
    """Both arrival RPCs of one transfer (3 prefill blocks, 3 decode blocks)."""
    stub = pbg.TransferServiceStub(channel)
    dec = pb.RegisterDecodeBlocksRequest(
        transfer_id=transfer_id,
        decode_engine_id=decode_engine,
        block_ids=blocks([7, 8, 9]),
        num_tokens=num_tokens,
    )
    pre = pb.ReportPrefillDoneRequest(
        transfer_id=transfer_id,
        prefill_engine_id=prefill_engine,
        block_ids=blocks([1, 2, 3]),
        num_tokens=num_tokens,
    )
    if decode_first:
        await stub.RegisterDecodeBlocks(dec)
        status: pb.TransferStatus = await stub.ReportPrefillDone(pre)
    else:
        await stub.ReportPrefillDone(pre)
        status = await stub.RegisterDecodeBlocks(dec)
    return status


TERMINAL_STATES = (
    pb.TRANSFER_STATE_COMPLETE,
    pb.TRANSFER_STATE_FAILED,
    pb.TRANSFER_STATE_CANCELLED,
    pb.TRANSFER_STATE_EXPIRED,
)


async def wait_terminal(
    channel: grpc.aio.Channel, transfer_ids: Sequence[str], timeout: float = DEFAULT_TIMEOUT
) -> dict[str, pb.TransferStatus]:
    """Wait until every transfer is terminal (WatchTransfers, no polling)."""
    want = set(transfer_ids)
    got: dict[str, pb.TransferStatus] = {}
    call: Any = pbg.StatusServiceStub(channel).WatchTransfers(
        pb.WatchTransfersRequest(states=TERMINAL_STATES, include_existing=True), timeout=timeout
    )
    try:
        async for event in call:
            if event.transfer.transfer_id in want:
                got[event.transfer.transfer_id] = event.transfer
                if len(got) == len(want):
                    break
    except grpc.aio.AioRpcError as exc:
        missing = sorted(want - set(got))
        raise AssertionError(f"not terminal within {timeout}s: {missing} ({exc.code()})") from None
    finally:
        call.cancel()
    return got


# ---------------------------------------------------------------- coordinator thread


class ThreadedCoordinator:
    """A coordinator on its own event loop in a daemon thread."""

    def __init__(self, core: CoreSettings | None = None) -> None:
        self._core = core or CoreSettings()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.coordinator: Coordinator | None = None

    def start(self) -> ThreadedCoordinator:
        self._thread.start()
        self.coordinator = self.run(start(ServerSettings(port=0, core=self._core)))
        return self

    @property
    def address(self) -> str:
        assert self.coordinator is not None
        return self.coordinator.address

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the coordinator's loop and wait for its result."""
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def stop(self) -> None:
        if self.coordinator is not None:
            self.run(self.coordinator.stop(0))
            self.coordinator = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> ThreadedCoordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
