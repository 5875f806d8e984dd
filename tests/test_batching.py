"""Batches: TransferService.Submit, AgentBatch up and CoordinatorBatch down.

Real coordinators on ephemeral ports; simulated agents (tests/support/sim_agent.py)
and the real agent link (agent/link.py).
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from pushkv.agent.link import CoordinatorLink
from pushkv.agent.link_messages import report_to_pb
from pushkv.agent.messages import (
    ArrivalMsg,
    Inbound,
    OrderMsg,
    PeerMsg,
    ReportStatus,
    WriteReportMsg,
)
from pushkv.controlplane.domain import AgentKey
from pushkv.controlplane.server import Coordinator
from pushkv.controlplane.servicers import MAX_SUBMIT_CALLS
from pushkv.controlplane.settings import CoreSettings
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimAgent, SimCluster, blocks, hello, wait_terminal

WAIT = 5.0
OK = grpc.StatusCode.OK.value[0]


@pytest.fixture
async def cluster(coord: Coordinator) -> AsyncIterator[SimCluster]:
    """p0/d0, TP 1, driven by hand."""
    async with SimCluster(coord.address, auto_complete=False) as c:
        yield c


@pytest.fixture
async def channel(coord: Coordinator) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(coord.address) as ch:
        yield ch


def register(tid: str, ids: list[int] | None = None, engine: str = "d0") -> pb.TransferCall:
    return pb.TransferCall(
        register=pb.RegisterDecodeBlocksRequest(
            transfer_id=tid,
            decode_engine_id=engine,
            block_ids=blocks(ids or [7, 8, 9]),
            num_tokens=40,
        )
    )


def prefill_done(tid: str, engine: str = "p0") -> pb.TransferCall:
    return pb.TransferCall(
        prefill_done=pb.ReportPrefillDoneRequest(
            transfer_id=tid, prefill_engine_id=engine, block_ids=blocks([1, 2, 3]), num_tokens=40
        )
    )


def cancel(tid: str) -> pb.TransferCall:
    return pb.TransferCall(cancel=pb.CancelRequest(transfer_id=tid, reason="test"))


async def submit(ch: grpc.aio.Channel, *calls: pb.TransferCall) -> list[pb.CallResult]:
    resp = await pbg.TransferServiceStub(ch).Submit(pb.SubmitRequest(calls=calls), timeout=WAIT)
    return list(resp.results)


async def unary_error(ch: grpc.aio.Channel, call: pb.TransferCall) -> tuple[int, str]:
    """What the unary RPC answers for the same call."""
    stub = pbg.TransferServiceStub(ch)
    kind = call.WhichOneof("kind")
    assert kind is not None
    rpc: Any = {
        "register": stub.RegisterDecodeBlocks,
        "prefill_done": stub.ReportPrefillDone,
        "cancel": stub.Cancel,
    }[kind]
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await rpc(getattr(call, kind), timeout=WAIT)
    return exc.value.code().value[0], exc.value.details() or ""


# ---------------------------------------------------------------- Submit


async def test_submit_applies_calls_in_order_each_with_its_own_result(
    channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    conflict = register("t1", [4, 5, 6])
    unknown_engine = register("t3", engine="nobody")
    results = await submit(
        channel,
        register("t1"),
        conflict,  # refused: t1 already has other blocks
        prefill_done("t1"),  # still applies: orders t1
        pb.TransferCall(),  # malformed: no call set
        unknown_engine,
        cancel("t2"),
        register("t2"),  # after the cancel: answered with the tombstone
    )
    assert [r.code for r in results] == [
        OK,
        grpc.StatusCode.ALREADY_EXISTS.value[0],
        OK,
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.FAILED_PRECONDITION.value[0],
        OK,
        OK,
    ]
    assert results[0].state == pb.TRANSFER_STATE_REGISTERED
    assert results[2].state == pb.TRANSFER_STATE_ORDERED and results[2].write_may_land
    assert results[3].message.startswith("empty call")
    assert results[5].state == results[6].state == pb.TRANSFER_STATE_CANCELLED
    # A refused call answers exactly what its unary RPC answers.
    for call, r in ((conflict, results[1]), (unknown_engine, results[4])):
        assert (r.code, r.message) == await unary_error(channel, call)
        assert r.state == pb.TRANSFER_STATE_UNSPECIFIED
    # The order went out as for the unary RPCs, and the transfer completes.
    [p], [d] = cluster.prefill, cluster.decode
    await p.expect("peer")
    order = await p.expect("order")
    assert order.transfer_id == "t1"
    await p.report_write(order, pb.WRITE_STATUS_DONE)
    await d.report_arrival("t1", [0])
    assert (await wait_terminal(channel, ["t1"]))["t1"].state == pb.TRANSFER_STATE_COMPLETE


async def test_prefill_done_carries_the_engines_finish_time_into_the_timeline(
    channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    """Submit and the unary RPC alike: finished_unix_us becomes the timeline's
    "prefill_finished" event, at the engine's time (observability only)."""
    batched, unary = prefill_done("f1"), prefill_done("f2")
    batched.prefill_done.finished_unix_us = 1_700_000_000_123_456
    unary.prefill_done.finished_unix_us = 1_700_000_000_654_321
    assert [r.code for r in await submit(channel, batched)] == [OK]
    await pbg.TransferServiceStub(channel).ReportPrefillDone(unary.prefill_done, timeout=WAIT)
    status = pbg.StatusServiceStub(channel)
    for tid, us in (("f1", 1_700_000_000_123_456), ("f2", 1_700_000_000_654_321)):
        t = await status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=WAIT)
        assert [(e.stage, e.unix_us) for e in t.timeline if e.stage.startswith("prefill")] == [
            ("prefill_finished", us),
            ("prefill_done", t.timeline[-1].unix_us),
        ]


async def test_submit_refuses_a_batch_over_the_limit_and_accepts_an_empty_one(
    channel: grpc.aio.Channel,
) -> None:
    stub = pbg.TransferServiceStub(channel)
    too_many = pb.SubmitRequest(calls=[cancel(f"c{i}") for i in range(MAX_SUBMIT_CALLS + 1)])
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Submit(too_many, timeout=WAIT)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAX_SUBMIT_CALLS) in (exc.value.details() or "")
    # Nothing of the refused batch was applied.
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await pbg.StatusServiceStub(channel).GetTransfer(pb.GetTransferRequest(transfer_id="c0"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert await submit(channel) == []
    full = await submit(channel, *(cancel(f"c{i}") for i in range(MAX_SUBMIT_CALLS)))
    assert {r.code for r in full} == {OK}


# ---------------------------------------------------------------- agent stream


@pytest.mark.parametrize("batching", [False, True], ids=["single", "batched"])
async def test_agents_with_and_without_batches_complete_transfers(
    coord: Coordinator, channel: grpc.aio.Channel, batching: bool
) -> None:
    async with SimCluster(coord.address, auto_complete=True, batching=batching) as c:
        ids = [f"t{i}" for i in range(12)]
        # Registrations and prefill reports of many transfers in one Submit:
        # their orders are queued for p0 at once.
        results = await submit(
            channel, *(register(t) for t in ids), *(prefill_done(t) for t in ids)
        )
        assert {r.code for r in results} == {OK}
        done = await wait_terminal(channel, ids)
        assert {t.state for t in done.values()} == {pb.TRANSFER_STATE_COMPLETE}
        [p] = c.prefill
        assert sorted(o.transfer_id for o in p.orders_seen) == sorted(ids)
        if batching:
            assert p.batches_seen >= 1  # the orders came down coalesced
        else:
            assert p.batches_seen == 0  # never a batch to an agent that did not ask


async def test_coordinator_batch_holds_only_what_was_queued_in_order(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    async with (
        SimAgent(coord.address, "p0", "prefill", batching=True) as p,
        SimAgent(coord.address, "d0", "decode") as d,
    ):
        ids = ["a", "b", "c"]
        await submit(channel, *(register(t) for t in ids), *(prefill_done(t) for t in ids))
        msgs = [await p.next() for _ in range(4)]
        assert [m.WhichOneof("kind") for m in msgs] == ["peer", "order", "order", "order"]
        assert [m.order.transfer_id for m in msgs[1:]] == ids
        assert p.batches_seen == 1  # all four in one CoordinatorMessage.batch
        # A lone message is never held back to wait for company.
        ack = await p.heartbeat()
        assert ack is not None and p.batches_seen == 1
        await d.heartbeat()
        assert d.batches_seen == 0


async def test_agent_batch_items_apply_in_order_and_a_bad_one_spares_the_rest(
    coord: Coordinator, channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    [p], [d] = cluster.prefill, cluster.decode
    await submit(channel, register("t"), prefill_done("t"))
    await p.expect("peer")
    order = await p.expect("order")
    posted = pb.AgentMessage(
        write=pb.WriteReport(
            order_id=order.order_id, transfer_id="t", status=pb.WRITE_STATUS_POSTED
        )
    )
    done = pb.AgentMessage(
        write=pb.WriteReport(order_id=order.order_id, transfer_id="t", status=pb.WRITE_STATUS_DONE)
    )
    nested = pb.AgentMessage(batch=pb.AgentBatch(messages=[done]))
    # A nested batch and a hello are refused item by item; the rest applies.
    await p.send_batch([posted, nested, pb.AgentMessage(hello=pb.AgentHello()), done])
    await d.send_batch(
        [
            pb.AgentMessage(arrival=pb.ArrivalReport(transfer_id="t", prefill_ranks=[5])),  # bad
            pb.AgentMessage(arrival=pb.ArrivalReport(transfer_id="t", prefill_ranks=[0])),
            pb.AgentMessage(heartbeat=pb.Heartbeat(seq=77)),
        ]
    )
    ack = await d.acks.get()
    assert ack.seq == 77  # the heartbeat inside the batch was answered
    st = (await wait_terminal(channel, ["t"]))["t"]
    assert st.state == pb.TRANSFER_STATE_COMPLETE
    stages = [e.stage for e in st.timeline]
    assert stages.index("write_posted") < stages.index("write_done")
    assert not p.ended.is_set() and not d.ended.is_set()  # both streams survive


# ---------------------------------------------------------------- the agent link


class _Collect:
    """Deliver callback of a link: collects inbound messages, wakes waiters."""

    def __init__(self) -> None:
        self.items: queue.Queue[Inbound] = queue.Queue()

    def __call__(self, msg: Inbound) -> None:
        self.items.put(msg)

    def take(self, n: int) -> list[Inbound]:
        return [self.items.get(timeout=WAIT) for _ in range(n)]


@pytest.mark.parametrize("batching", [False, True], ids=["single", "batched"])
async def test_the_link_batches_both_ways_only_when_enabled(
    coord: Coordinator, channel: grpc.aio.Channel, batching: bool
) -> None:
    seen: list[str] = []  # what the link put on the wire
    got = _Collect()
    link = CoordinatorLink(coord.address, hello("p0", "prefill").hello, got, batching=batching)
    coalesce = link._coalesce

    def spy(first: Any) -> pb.AgentMessage:
        msg = coalesce(first)
        seen.append(msg.WhichOneof("kind") or "")
        return msg

    link._coalesce = spy  # type: ignore[method-assign]
    # Reports queued before the stream opens go up together (or one by one).
    for i in range(3):
        link.send(ArrivalMsg(f"x{i}", (0,)))
    async with SimAgent(coord.address, "d0", "decode"):
        link.start()
        try:
            assert await asyncio.to_thread(link.registered.wait, WAIT)
            await submit(channel, *(register(t) for t in "abc"), *(prefill_done(t) for t in "abc"))
            msgs = await asyncio.to_thread(got.take, 4)
            assert isinstance(msgs[0], PeerMsg)
            assert [m.transfer_id for m in msgs[1:] if isinstance(m, OrderMsg)] == list("abc")
            session = coord.runtime._sessions[AgentKey("p0", 0)]  # type: ignore[arg-type]
            assert session.accepts_batches is batching
        finally:
            await asyncio.to_thread(link.stop)
    reports = [k for k in seen if k in ("arrival", "batch")]
    assert reports == (["batch"] if batching else ["arrival"] * 3)


async def test_an_outbox_batch_keeps_orders_and_messages_in_order() -> None:
    from pushkv.controlplane import convert
    from pushkv.controlplane.clock import SystemClock
    from pushkv.controlplane.domain import EngineId, Order, OrderId, TransferId
    from pushkv.controlplane.runtime import Runtime

    rt = Runtime(CoreSettings(), SystemClock())
    session = rt.open_session(
        convert.registration_from_pb(hello("p0", "prefill").hello), accepts_batches=True
    )
    while not session.outbox.empty():
        session.outbox.get_nowait()  # the welcome

    def order(tid: str) -> Order:
        return Order(OrderId("o-" + tid), TransferId(tid), EngineId("p0"), 0, "i1", (), 0.0, 16)

    session.send(order("t1"))
    session.send(pb.CoordinatorMessage(notice=pb.TransferNotice(transfer_id="n1")))
    session.send(order("t2"))
    session.close()
    first = session.outbox.get_nowait()
    assert first is not None
    out, ended = session.take(first)
    assert ended
    got = [
        (m.WhichOneof("kind"), m.order.transfer_id or m.notice.transfer_id)
        for m in out.batch.messages
    ]
    assert got == [("order", "t1"), ("notice", "n1"), ("order", "t2")]
    assert out.batch.messages[0].order.num_tokens == 16

    lone = Runtime(CoreSettings(), SystemClock()).open_session(
        convert.registration_from_pb(hello("p0", "prefill").hello), accepts_batches=True
    )
    while not lone.outbox.empty():
        lone.outbox.get_nowait()
    lone.send(order("t3"))
    queued = lone.outbox.get_nowait()
    assert queued is not None
    msg, ended = lone.take(queued)
    assert not ended and msg.WhichOneof("kind") == "order" and msg.order.transfer_id == "t3"


def test_reports_carry_the_agents_stamp_of_the_event() -> None:
    before = time.time()
    done = WriteReportMsg("o1", "t1", ReportStatus.DONE)
    arrival = ArrivalMsg("t1", (0, 1))
    after = time.time()
    # Stamped when made (the NIXL thread makes a report as it sees the event) ...
    assert before <= done.at_unix <= after and before <= arrival.at_unix <= after
    # ... not part of what the report says.
    assert done == WriteReportMsg("o1", "t1", ReportStatus.DONE, at_unix=1.0)
    # On the wire in µs.
    w = report_to_pb(WriteReportMsg("o1", "t1", ReportStatus.POSTED, at_unix=12.5))
    a = report_to_pb(ArrivalMsg("t1", (0,), at_unix=7.25))
    assert (w.write.at_unix_us, a.arrival.at_unix_us) == (12_500_000, 7_250_000)
