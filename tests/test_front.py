"""The front over partition processes (controlplane/front.py): real partition
processes (controlplane/partition_host.py) on real Unix sockets, and the test
playing one node relay on a NodeStream served by the front."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import grpc
import pytest

from pushkv.bench.coordinator_workload import (
    CORE_SETTINGS,
    DECODE,
    PREFILL,
    agent_hello,
    decode_request,
    prefill_request,
)
from pushkv.controlplane.errors import NotFound, PushKVError
from pushkv.controlplane.front import PartitionFront
from pushkv.controlplane.partition_link import PartitionProcess
from pushkv.controlplane.partitions import partition_of
from pushkv.controlplane.settings import CoreSettings
from pushkv.v1 import partition_pb2 as ppb
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.core_shapes import ids_in_partition

DEADLINE_S = 30.0
TERMINAL = (
    pb.TRANSFER_STATE_COMPLETE,
    pb.TRANSFER_STATE_FAILED,
    pb.TRANSFER_STATE_CANCELLED,
    pb.TRANSFER_STATE_EXPIRED,
)
K = 2
P, D = 1, 2  # the relay's channels: the prefill and the decode agent (TP 1)
T = TypeVar("T")


class Node:
    """A node relay on one NodeStream through the front: what it sends, and
    every ChannelDown it got, in order."""

    def __init__(self, front: PartitionFront) -> None:
        self._front = front
        self._up: asyncio.Queue[pb.NodeUp | None] = asyncio.Queue()
        self.got: list[pb.ChannelDown] = []
        self._changed = asyncio.Event()
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None

    async def _requests(self) -> AsyncIterator[pb.NodeUp]:
        while (up := await self._up.get()) is not None:
            yield up

    async def _read(self) -> None:
        async for down in self._front.stream("test-relay").serve(self._requests()):
            self.got.extend(down.items)
            self._changed.set()

    def start(self) -> Node:
        self._task = asyncio.create_task(self._read())
        return self

    async def end(self) -> None:
        self._up.put_nowait(None)
        assert self._task is not None
        await asyncio.wait_for(self._task, DEADLINE_S)

    def send(self, *items: pb.ChannelUp) -> None:
        self._up.put_nowait(pb.NodeUp(items=items))

    def say(self, channel: int, msg: pb.AgentMessage) -> None:
        self.send(pb.ChannelUp(channel=channel, message=msg))

    async def until(self, what: str, check: Callable[[], T | None]) -> T:
        """Wait, within the deadline, for `check` to return a truthy value."""

        async def loop() -> T:
            while not (got := check()):
                self._changed.clear()
                await self._changed.wait()
            return got

        try:
            return await asyncio.wait_for(loop(), DEADLINE_S)
        except TimeoutError:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}; got {self.got}") from None

    async def submit(self, calls: list[pb.TransferCall]) -> pb.RelayedSubmitReply:
        rid = next(self._ids)
        req = pb.SubmitRequest(calls=calls)
        self.send(pb.ChannelUp(submit=pb.RelayedSubmit(id=rid, request=req)))
        return await self.until(
            f"the answer to Submit {rid}",
            lambda: next(
                (
                    i.submitted
                    for i in self.got
                    if i.HasField("submitted") and i.submitted.id == rid
                ),
                None,
            ),
        )

    def messages(self, channel: int) -> list[pb.CoordinatorMessage]:
        """What channel `channel` got, batches unwrapped."""
        out: list[pb.CoordinatorMessage] = []
        for i in self.got:
            if i.channel == channel and i.HasField("message"):
                m = i.message
                out.extend(m.batch.messages if m.WhichOneof("kind") == "batch" else (m,))
        return out

    def kinds(self, channel: int) -> list[str]:
        return [str(m.WhichOneof("kind")) for m in self.messages(channel)]

    def orders(self, channel: int) -> list[pb.TransferOrder]:
        return [m.order for m in self.messages(channel) if m.WhichOneof("kind") == "order"]


def answers(item: pb.ChannelDown, rid: int) -> bool:
    return item.HasField("submitted") and item.submitted.id == rid


def hello(channel: int) -> pb.ChannelUp:
    engine, role = (PREFILL, pb.ROLE_PREFILL) if channel == P else (DECODE, pb.ROLE_DECODE)
    h = agent_hello(engine, role, batched=True)
    return pb.ChannelUp(channel=channel, message=pb.AgentMessage(hello=h))


def cancel(tid: str) -> pb.TransferCall:
    return pb.TransferCall(cancel=pb.CancelRequest(transfer_id=tid, reason="test"))


def reports(o: pb.TransferOrder) -> list[pb.ChannelUp]:
    """The prefill agent's POSTED and DONE, and the decode agent's arrival."""
    writes = [
        pb.AgentMessage(
            write=pb.WriteReport(order_id=o.order_id, transfer_id=o.transfer_id, status=s)
        )
        for s in (pb.WRITE_STATUS_POSTED, pb.WRITE_STATUS_DONE)
    ]
    arrival = pb.ArrivalReport(transfer_id=o.transfer_id, prefill_ranks=[o.prefill_rank])
    return [
        pb.ChannelUp(channel=P, message=pb.AgentMessage(batch=pb.AgentBatch(messages=writes))),
        pb.ChannelUp(channel=D, message=pb.AgentMessage(arrival=arrival)),
    ]


def with_partitions(
    body: Callable[[PartitionFront, list[PartitionProcess]], Awaitable[None]],
    *,
    exits_clean: bool = True,
    **settings: Any,
) -> None:
    """Run `body` with K real partition processes and a front over them;
    each then exits 0, unless `exits_clean` is False (a body that kills one)."""

    async def run() -> None:
        with tempfile.TemporaryDirectory(prefix="pushkv-front-") as d:
            cs = CoreSettings(**{**CORE_SETTINGS, **settings})
            parts = [
                await PartitionProcess.start(d, i, K, term=2, coordinator_id="c", settings=cs)
                for i in range(K)
            ]
            front = PartitionFront(parts)
            front.start()
            try:
                await body(front, parts)
            finally:
                await front.stop()
                codes = [await p.close() for p in parts]
            if exits_clean:
                assert codes == [0] * K

    asyncio.run(run())


def with_front(body: Callable[[PartitionFront], Awaitable[None]], **settings: Any) -> None:
    """Run `body` with a front over K real partition processes."""
    with_partitions(lambda front, _: body(front), **settings)


@pytest.fixture
def ids() -> Iterator[tuple[list[str], list[str]]]:
    """Transfer ids in partition 0, and in partition 1."""
    yield ids_in_partition(0, 3, K, "t"), ids_in_partition(1, 3, K, "t")


def test_each_agent_is_welcomed_and_acked_once_and_told_of_a_peer_once(
    ids: tuple[list[str], list[str]],
) -> None:
    """Both partitions welcome each agent, ack its heartbeats and introduce
    the decode agent to the prefill agent before their first order; the relay
    gets each once, the welcome first on every channel."""
    (a, a2, _), (b, b2, _) = ids

    async def body(front: PartitionFront) -> None:
        node = Node(front).start()
        node.send(hello(P), hello(D))
        await node.until("both welcomed", lambda: "welcome" in node.kinds(P) + node.kinds(D))
        node.say(P, pb.AgentMessage(heartbeat=pb.Heartbeat(seq=7)))
        for t in (a, b):  # one transfer in each partition: each introduces the peer
            reply = await node.submit(
                [
                    pb.TransferCall(register=decode_request(t)),
                    pb.TransferCall(prefill_done=prefill_request(t)),
                ]
            )
            assert reply.code == 0, reply
        await node.until("both orders", lambda: len(node.orders(P)) == 2)
        # A barrier in each partition (a cancel of a transfer not yet begun, which
        # it records): answered after everything sent there before it.
        reply = await node.submit([cancel(a2), cancel(b2)])
        assert [r.state for r in reply.response.results] == [pb.TRANSFER_STATE_CANCELLED] * 2
        kinds = node.kinds(P)
        assert kinds[0] == "welcome" and node.kinds(D)[0] == "welcome", (kinds, node.kinds(D))
        assert kinds.count("welcome") == 1 and node.kinds(D).count("welcome") == 1
        assert kinds.count("heartbeat_ack") == 1, kinds
        assert kinds.count("peer") == 1 and kinds.index("peer") < kinds.index("order"), kinds
        assert {o.transfer_id for o in node.orders(P)} == {a, b}
        assert {o.order_id.split("-")[0] for o in node.orders(P)} == {"c.0", "c.1"}
        await node.end()

    with_front(body)


def test_a_submit_across_partitions_is_answered_in_the_callers_order(
    ids: tuple[list[str], list[str]],
) -> None:
    """Calls for transfers in both partitions, interleaved, one unknown: the
    answers come back in the calls' order, each from its transfer's partition."""
    (a0, a1, _), (b0, b1, _) = ids

    async def body(front: PartitionFront) -> None:
        node = Node(front).start()
        node.send(hello(P), hello(D))
        calls = [
            pb.TransferCall(register=decode_request(a0)),
            pb.TransferCall(register=decode_request(b0)),
            cancel(b1),  # not begun: recorded CANCELLED
            pb.TransferCall(prefill_done=prefill_request(a1)),
            pb.TransferCall(prefill_done=prefill_request(b0)),
        ]
        reply = await node.submit(calls)
        assert reply.code == 0 and reply.response.term == 2, reply
        got = [(r.code, r.state) for r in reply.response.results]
        assert got == [
            (0, pb.TRANSFER_STATE_REGISTERED),
            (0, pb.TRANSFER_STATE_REGISTERED),
            (0, pb.TRANSFER_STATE_CANCELLED),
            (0, pb.TRANSFER_STATE_PREFILL_DONE),
            (0, pb.TRANSFER_STATE_ORDERED),
        ], reply
        # Over the limit: refused whole, as the coordinator's Submit refuses it.
        big = await node.submit([cancel(a0)] * 1025)
        assert big.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], big
        # An empty Submit: a probe of the term.
        probe = await node.submit([])
        assert probe.code == 0 and probe.response.term == 2 and not probe.response.results
        await node.end()

    with_front(body)


def test_a_refused_hello_ends_the_channel_once() -> None:
    """Every partition refuses a hello of another protocol version: the relay
    gets one end, with the refusal's code."""

    async def body(front: PartitionFront) -> None:
        node = Node(front).start()
        bad = hello(P)
        bad.message.hello.protocol_version += 1
        node.send(bad, hello(D))
        await node.until("the bad channel ended", lambda: any(i.ended for i in node.got))
        await node.until("the good one welcomed", lambda: "welcome" in node.kinds(D))
        # Both partitions answered the bad hello before a barrier in each.
        await node.submit([cancel(ids_in_partition(i, 1, K, "x")[0]) for i in range(K)])
        ends = [i for i in node.got if i.ended]
        assert [(i.channel, i.code) for i in ends] == [
            (P, grpc.StatusCode.FAILED_PRECONDITION.value[0])
        ], ends
        await node.end()

    with_front(body)


def test_a_relay_stream_lost_leaves_its_transfers_for_the_agents_return(
    ids: tuple[list[str], list[str]],
) -> None:
    """The relay's stream ends with a transfer ordered (in partition 1) and
    not written. The front tells every partition the link was lost, not that
    the agents hung up: with no reconnect grace, an agent's own end would fail
    the transfer at once; lost, it waits for the agents' lease. The relay
    comes back with the same agents: partition 1 sends the order again, and
    the transfer completes."""
    _, (b, _, _) = ids

    async def body(front: PartitionFront) -> None:
        first = Node(front).start()
        first.send(hello(P), hello(D))
        reply = await first.submit(
            [
                pb.TransferCall(register=decode_request(b)),
                pb.TransferCall(prefill_done=prefill_request(b)),
            ]
        )
        assert [r.state for r in reply.response.results][-1] == pb.TRANSFER_STATE_ORDERED
        await first.until("the order", lambda: first.orders(P))
        await first.end()

        again = Node(front).start()
        again.send(hello(P), hello(D))
        (order,) = await again.until("the order sent again", lambda: again.orders(P))
        assert order.transfer_id == b and again.kinds(P)[0] == "welcome"
        again.send(*reports(order))
        (state,) = (await again.submit([cancel(b)])).response.results
        assert state.state == pb.TRANSFER_STATE_COMPLETE, state
        await again.end()

    with_front(body, reconnect_grace_s=0)


def test_an_agent_hanging_up_on_the_relay_fails_its_transfer_at_once(
    ids: tuple[list[str], list[str]],
) -> None:
    """The converse: the relay says the prefill agent's channel closed (the
    agent hung up). With no reconnect grace, partition 1 fails its ordered
    transfer at once."""
    _, (b, _, _) = ids

    async def body(front: PartitionFront) -> None:
        node = Node(front).start()
        node.send(hello(P), hello(D))
        await node.submit(
            [
                pb.TransferCall(register=decode_request(b)),
                pb.TransferCall(prefill_done=prefill_request(b)),
            ]
        )
        await node.until("the order", lambda: node.orders(P))
        node.send(pb.ChannelUp(channel=P, closed=True))
        await node.until("the channel ended", lambda: any(i.ended for i in node.got))
        (state,) = (await node.submit([cancel(b)])).response.results
        assert state.state == pb.TRANSFER_STATE_FAILED, state
        await node.end()

    with_front(body, reconnect_grace_s=0)


def test_partition_of_routes_the_test_ids() -> None:
    (a,) = ids_in_partition(0, 1, K, "t")
    (b,) = ids_in_partition(1, 1, K, "t")
    assert (partition_of(a, K), partition_of(b, K)) == (0, 1)


def test_rpcs_go_to_a_transfers_partition_and_reads_merge_all(
    ids: tuple[list[str], list[str]],
) -> None:
    """BeginTransfer, the unary sides and GetTransfer each at the transfer's
    partition; ListTransfers merged newest first with every partition's
    matches counted; ListEngines from one registry copy with the engines'
    transfers summed over the partitions; a partition's refusal told with its
    code."""
    (a0, a1, a2), (b0, b1, _) = ids

    def begin(t: str) -> ppb.PartitionCall:
        return ppb.PartitionCall(
            begin=pb.BeginTransferRequest(
                transfer_id=t, prefill_engine_id=PREFILL, decode_engine_id=DECODE
            )
        )

    async def body(front: PartitionFront) -> None:
        node = Node(front).start()
        node.send(hello(P), hello(D))
        await node.until("both welcomed", lambda: "welcome" in node.kinds(D))
        for t in (a0, b0, a1, b1):  # created in this order, in both partitions
            st = await front.transfer_call(begin(t), t)
            assert st.transfer_id == t and st.state == pb.TRANSFER_STATE_AWAITING, st
        st = await front.transfer_call(ppb.PartitionCall(register=decode_request(b0)), b0)
        assert st.state == pb.TRANSFER_STATE_ARMED, st  # the prefill engine was announced
        got = await front.transfer_call(
            ppb.PartitionCall(get=pb.GetTransferRequest(transfer_id=b0)), b0
        )
        assert got.state == pb.TRANSFER_STATE_ARMED and got.decode_engine_id == DECODE
        with pytest.raises(NotFound):
            await front.transfer_call(
                ppb.PartitionCall(get=pb.GetTransferRequest(transfer_id=a2)), a2
            )

        listed = await front.list_transfers(pb.ListTransfersRequest(limit=3))
        assert listed.total_matching == 4
        assert [t.transfer_id for t in listed.transfers] == [b1, a1, b0], listed
        armed = await front.list_transfers(
            pb.ListTransfersRequest(states=[pb.TRANSFER_STATE_ARMED])
        )
        assert [t.transfer_id for t in armed.transfers] == [b0]

        listed_engines = await front.list_engines(pb.ListEnginesRequest())
        engines = {e.engine_id: e for e in listed_engines.engines}
        assert set(engines) == {PREFILL, DECODE}
        assert engines[DECODE].inflight_transfers == 4, engines[DECODE]  # 2 per partition
        (rank,) = engines[PREFILL].ranks
        assert rank.inflight_orders == 1, rank  # b0's armed order, in partition 1
        await node.end()

    with_front(body)


class OwnStream:
    """An agent on its own AgentStream through the front."""

    def __init__(self, front: PartitionFront, first: pb.AgentMessage) -> None:
        self._up: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self._up.put_nowait(first)
        self.got: list[pb.CoordinatorMessage] = []
        self.first: asyncio.Future[pb.CoordinatorMessage]
        self.error: PushKVError | None = None
        self.first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._read(front))

    async def _requests(self) -> AsyncIterator[pb.AgentMessage]:
        while (m := await self._up.get()) is not None:
            yield m

    async def _read(self, front: PartitionFront) -> None:
        try:
            async for m in front.agent_stream(self._requests()):
                self.got.append(m)
                if not self.first.done():
                    self.first.set_result(m)
        except PushKVError as exc:
            self.error = exc

    def say(self, m: pb.AgentMessage) -> None:
        self._up.put_nowait(m)

    async def end(self) -> None:
        self._up.put_nowait(None)
        await asyncio.wait_for(self._task, DEADLINE_S)


def test_an_agents_own_stream_and_the_submit_rpc(ids: tuple[list[str], list[str]]) -> None:
    """The decode agent on its own AgentStream, the prefill agent through a
    relay, the sides as a Submit RPC: the transfer completes; ListEngines
    names the relay for the relayed rank only; the own stream's end is the
    agent's own (no reconnect grace: its ordered transfer fails at once,
    where a relay's lost stream waits for the agent)."""
    (a, _, _), (b, _, _) = ids

    async def body(front: PartitionFront) -> None:
        node = Node(front).start()
        node.send(hello(P))
        decode = OwnStream(front, hello(D).message)
        await node.until("the prefill agent welcomed", lambda: "welcome" in node.kinds(P))

        def sides(t: str) -> pb.SubmitRequest:
            return pb.SubmitRequest(
                calls=[
                    pb.TransferCall(register=decode_request(t)),
                    pb.TransferCall(prefill_done=prefill_request(t)),
                ]
            )

        answer = await front.submit_rpc(sides(a))
        assert [r.state for r in answer.results] == [
            pb.TRANSFER_STATE_REGISTERED,
            pb.TRANSFER_STATE_ORDERED,
        ], answer
        (order,) = await node.until("a's order", lambda: node.orders(P))
        writes, arrival = reports(order)
        node.send(writes)
        decode.say(arrival.message)

        async def status(t: str) -> pb.TransferStatus:
            call = ppb.PartitionCall(get=pb.GetTransferRequest(transfer_id=t))
            return await front.transfer_call(call, t)

        async def ended(t: str) -> pb.TransferStatus:
            """t's status once terminal (the reports go up on other tasks)."""
            deadline = asyncio.get_running_loop().time() + DEADLINE_S
            while (st := await status(t)).state not in TERMINAL:
                assert asyncio.get_running_loop().time() < deadline, f"{t} not ended"
                await asyncio.sleep(0.02)  # polling another process under a deadline
            return st

        assert (await ended(a)).state == pb.TRANSFER_STATE_COMPLETE
        first = await asyncio.wait_for(decode.first, DEADLINE_S)
        assert first.WhichOneof("kind") == "welcome", decode.got

        listed = await front.list_engines(pb.ListEnginesRequest())
        relays = {(e.engine_id, rl.tp_rank): rl.relay for e in listed.engines for rl in e.ranks}
        assert relays == {(PREFILL, 0): "test-relay", (DECODE, 0): ""}, relays

        await front.submit_rpc(sides(b))
        await node.until("b's order", lambda: len(node.orders(P)) == 2)
        await decode.end()
        assert decode.error is None
        failed = await ended(b)
        assert failed.state == pb.TRANSFER_STATE_FAILED, failed
        assert "lease expired" not in failed.detail, failed  # at its end, not its lease
        await node.end()

    with_front(body, reconnect_grace_s=0)
