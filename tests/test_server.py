"""The coordinator through real gRPC stubs and simulated agents (tests/support/sim_agent.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pushkv.controlplane.server import Coordinator, ServerSettings, start
from pushkv.controlplane.settings import CoreSettings
from pushkv.protocol import PROTOCOL_VERSION
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimAgent, SimCluster, blocks, hello, rendezvous, wait_terminal

WAIT = 5.0
TERMINAL = {
    pb.TRANSFER_STATE_COMPLETE,
    pb.TRANSFER_STATE_FAILED,
    pb.TRANSFER_STATE_CANCELLED,
    pb.TRANSFER_STATE_EXPIRED,
}

MakeCoord = Callable[..., Awaitable[Coordinator]]


@pytest.fixture
async def make_coord() -> AsyncIterator[MakeCoord]:
    started: list[Coordinator] = []

    async def make(**core: Any) -> Coordinator:
        c = await start(ServerSettings(port=0, core=CoreSettings(**core)))
        started.append(c)
        return c

    yield make
    for c in started:
        await c.stop(0)


@pytest.fixture
async def coord(make_coord: MakeCoord) -> Coordinator:
    return await make_coord()


@pytest.fixture
async def channel(coord: Coordinator) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(coord.address) as ch:
        yield ch


@pytest.fixture
async def cluster(coord: Coordinator) -> AsyncIterator[SimCluster]:
    """p0/d0, TP 1, driven by hand (no auto-completion)."""
    async with SimCluster(coord.address, auto_complete=False) as c:
        yield c


def transfers(ch: grpc.aio.Channel) -> pbg.TransferServiceAsyncStub:
    return pbg.TransferServiceStub(ch)


def status(ch: grpc.aio.Channel) -> pbg.StatusServiceAsyncStub:
    return pbg.StatusServiceStub(ch)


async def get(ch: grpc.aio.Channel, tid: str) -> pb.TransferStatus:
    return await status(ch).GetTransfer(pb.GetTransferRequest(transfer_id=tid))


async def rpc_error(awaitable: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await asyncio.wait_for(awaitable, WAIT)
    return exc.value


def error_details(err: grpc.aio.AioRpcError) -> str:
    """The error's details, which every refusal here carries."""
    text = err.details()
    assert text is not None, err
    return text


def decode_req(
    tid: str, ids: list[int], num_tokens: int = 40, engine: str = "d0"
) -> pb.RegisterDecodeBlocksRequest:
    return pb.RegisterDecodeBlocksRequest(
        transfer_id=tid, decode_engine_id=engine, block_ids=blocks(ids), num_tokens=num_tokens
    )


def prefill_req(
    tid: str, ids: list[int], num_tokens: int = 40, engine: str = "p0"
) -> pb.ReportPrefillDoneRequest:
    return pb.ReportPrefillDoneRequest(
        transfer_id=tid, prefill_engine_id=engine, block_ids=blocks(ids), num_tokens=num_tokens
    )


def same_status(a: pb.TransferStatus, b: pb.TransferStatus) -> bool:
    """Equal, except that the wall-clock deadline is re-derived per call (µs jitter)."""
    if abs(a.deadline_unix_us - b.deadline_unix_us) > 1000:
        return False
    a2, b2 = pb.TransferStatus(), pb.TransferStatus()
    a2.CopyFrom(a)
    b2.CopyFrom(b)
    a2.deadline_unix_us = b2.deadline_unix_us = 0
    return a2 == b2


async def settle(*agents: SimAgent) -> None:
    """Every report an agent sent before this has been applied by the coordinator.

    The coordinator handles an agent's messages in order, so the ack of a
    heartbeat sent after the reports proves they were processed.
    """
    await asyncio.gather(*(a.heartbeat() for a in agents))


def drain(agent: SimAgent) -> list[pb.CoordinatorMessage]:
    """Everything in the agent's inbox now (call after `settle`/a heartbeat)."""
    out = []
    while not agent.inbox.empty():
        msg = agent.inbox.get_nowait()
        if msg is not None:
            out.append(msg)
    return out


async def finish(p: SimAgent, d: SimAgent, order: pb.TransferOrder) -> None:
    await p.report_write(order, pb.WRITE_STATUS_POSTED)
    await p.report_write(order, pb.WRITE_STATUS_DONE)
    await d.report_arrival(order.transfer_id, [order.prefill_rank])


# ---------------------------------------------------------------- the core flow


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "prefill-first"])
async def test_rendezvous_orders_the_prefill_agent_and_completes(
    channel: grpc.aio.Channel, cluster: SimCluster, decode_first: bool
) -> None:
    [p], [d] = cluster.prefill, cluster.decode
    st = await rendezvous(channel, "t1", decode_first=decode_first)
    assert st.state == pb.TRANSFER_STATE_ORDERED
    assert st.outstanding_ranks == [0] and st.write_may_land

    # PeerInfo for the decode rank comes before the first order that targets it.
    peer = await p.expect("peer")
    assert peer.identity.engine_id == "d0" and peer.identity.tp_rank == 0
    assert peer.identity.role == pb.ROLE_DECODE and peer.identity.incarnation == "i1"
    assert peer.nixl_agent_name == d.hello.hello.nixl_agent_name
    assert peer.nixl_metadata == d.hello.hello.nixl_metadata == b"md:d0/0@i1"
    assert peer.layout == d.hello.hello.layout

    order = await p.expect("order")
    assert order.transfer_id == "t1" and order.prefill_rank == 0
    assert order.prefill_incarnation == "i1" and order.num_tokens == 40
    [tgt] = order.targets
    assert (tgt.decode_engine_id, tgt.decode_rank, tgt.decode_incarnation) == ("d0", 0, "i1")
    assert [list(g.ids) for g in tgt.src_blocks] == [[1, 2, 3]]
    assert [list(g.ids) for g in tgt.dst_blocks] == [[7, 8, 9]]
    assert tgt.expected_writers == 1

    await p.report_write(order, pb.WRITE_STATUS_POSTED)
    await settle(p)
    st = await get(channel, "t1")
    assert st.state == pb.TRANSFER_STATE_WRITING
    assert st.ranks[0].state == pb.RANK_STATE_POSTED and not st.ranks[0].arrived

    await p.report_write(order, pb.WRITE_STATUS_DONE)
    await d.report_arrival("t1", [0])
    st = (await wait_terminal(channel, ["t1"]))["t1"]
    # A clean COMPLETE sends no notice: each agent already knew (DONE / arrival).
    for agent in (p, d):
        await agent.heartbeat()  # everything sent before this ack is in the inbox
        assert [m for m in drain(agent) if m.WhichOneof("kind") == "notice"] == []

    assert st.state == pb.TRANSFER_STATE_COMPLETE
    assert list(st.outstanding_ranks) == [] and not st.write_may_land
    assert st.ranks[0].order_id == order.order_id
    assert st.ranks[0].state == pb.RANK_STATE_DONE and st.ranks[0].arrived
    stages = [e.stage for e in st.timeline]
    assert stages[-1] == "complete" and "ordered" in stages and "arrived" in stages


async def test_auto_completing_sims_finish_many_transfers(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    async with SimCluster(coord.address, auto_complete=True) as c:
        ids = [f"t{i}" for i in range(20)]
        await asyncio.gather(
            *(rendezvous(channel, tid, decode_first=i % 2 == 0) for i, tid in enumerate(ids))
        )
        done = await wait_terminal(channel, ids)
        assert {t.state for t in done.values()} == {pb.TRANSFER_STATE_COMPLETE}
        assert sorted(o.transfer_id for o in c.prefill[0].orders_seen) == sorted(ids)


async def test_retried_arrival_returns_the_same_status_and_conflicts_name_the_field(
    channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    first = await transfers(channel).RegisterDecodeBlocks(decode_req("t", [4, 5]))
    again = await transfers(channel).RegisterDecodeBlocks(decode_req("t", [4, 5]))
    assert first.state == again.state == pb.TRANSFER_STATE_REGISTERED
    assert same_status(first, again)  # nothing changed, not even the timeline

    err = await rpc_error(transfers(channel).RegisterDecodeBlocks(decode_req("t", [4, 6])))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error_details(err).startswith("block_ids:")
    err = await rpc_error(transfers(channel).RegisterDecodeBlocks(decode_req("t", [4, 5], 41)))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error_details(err).startswith("num_tokens:")

    # A retried prefill report after the order never issues a second order.
    [p] = cluster.prefill
    st1 = await transfers(channel).ReportPrefillDone(prefill_req("t", [1, 2, 3]))
    st2 = await transfers(channel).ReportPrefillDone(prefill_req("t", [1, 2, 3]))
    assert st1.state == st2.state == pb.TRANSFER_STATE_ORDERED
    assert st1.ranks == st2.ranks
    await p.expect("peer")
    assert (await p.expect("order")).transfer_id == "t"
    await rendezvous(channel, "next")
    assert (await p.expect("order")).transfer_id == "next"


async def test_cancel_before_the_order_means_no_order_is_ever_sent(
    channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    [p], [d] = cluster.prefill, cluster.decode
    await transfers(channel).RegisterDecodeBlocks(decode_req("gone", [7, 8, 9]))
    st = await transfers(channel).Cancel(pb.CancelRequest(transfer_id="gone", reason="client left"))
    assert st.state == pb.TRANSFER_STATE_CANCELLED and st.reason == pb.REASON_CANCELLED
    assert st.detail == "client left" and not st.write_may_land
    n = await d.expect("notice")
    assert (n.transfer_id, n.state, n.write_may_land) == (
        "gone",
        pb.TRANSFER_STATE_CANCELLED,
        False,
    )

    late = await transfers(channel).ReportPrefillDone(prefill_req("gone", [1, 2, 3]))
    assert late.state == pb.TRANSFER_STATE_CANCELLED
    # The prefill engine was not named when "gone" ended: its late report is told.
    n = await p.expect("notice")
    assert (n.transfer_id, n.state, n.write_may_land) == (
        "gone",
        pb.TRANSFER_STATE_CANCELLED,
        False,
    )

    # The next transfer's order is the first and only order the prefill rank sees.
    await rendezvous(channel, "kept")
    await p.expect("peer")
    order = await p.expect("order")
    assert order.transfer_id == "kept"
    await finish(p, d, order)
    done = await wait_terminal(channel, ["kept"])
    assert done["kept"].state == pb.TRANSFER_STATE_COMPLETE
    assert [o.transfer_id for o in p.orders_seen] == ["kept"]


@pytest.mark.parametrize("end", ["cancelled", "expired"])
async def test_a_side_that_arrives_after_the_end_is_told_on_every_rank(
    make_coord: MakeCoord, end: str
) -> None:
    """TransferNotice goes to every rank of both engines, even one that came too late.

    A host that frees its blocks on notices must not hold them because its
    engine's report arrived after the transfer ended (it was not named then).
    """
    coord = await make_coord(**({"rendezvous_timeout_s": 0.2} if end == "expired" else {}))
    async with (
        SimCluster(coord.address, tp_size=2, auto_complete=False) as cl,
        grpc.aio.insecure_channel(coord.address) as ch,
    ):
        if end == "cancelled":  # no BeginTransfer: the transfer names no engine
            st = await transfers(ch).Cancel(pb.CancelRequest(transfer_id="late", reason="gone"))
            state, reason = pb.TRANSFER_STATE_CANCELLED, pb.REASON_CANCELLED
        else:  # decode registered, prefill never came in time
            await transfers(ch).RegisterDecodeBlocks(decode_req("late", [7, 8, 9]))
            st = (await wait_terminal(ch, ["late"]))["late"]
            state, reason = pb.TRANSFER_STATE_EXPIRED, pb.REASON_DEADLINE
            for d in cl.decode:
                assert (await d.expect("notice")).state == state
        assert st.state == state

        late = await transfers(ch).ReportPrefillDone(prefill_req("late", [1, 2, 3]))
        assert late.state == state and not late.write_may_land
        for p in cl.prefill:
            n = await p.expect("notice")
            assert (n.transfer_id, n.state, n.reason, n.write_may_land) == (
                "late",
                state,
                reason,
                False,
            )
        # Through Submit, a decode side that comes too late is told the same way.
        call = pb.TransferCall(register=decode_req("late", [7, 8, 9]))
        [res] = (await transfers(ch).Submit(pb.SubmitRequest(calls=[call]))).results
        assert (res.code, res.state) == (0, state)
        if end == "cancelled":
            for d in cl.decode:
                assert (await d.expect("notice")).state == state
        # No order was ever issued, and nothing else reached any rank.
        await settle(*cl.agents)
        for agent in cl.agents:
            kinds = {m.WhichOneof("kind") for m in drain(agent)}
            assert kinds <= {"heartbeat_ack"}, (agent.key, kinds)
            assert agent.orders_seen == []


async def test_cancel_after_the_order_fences_decode_blocks_until_dropped(
    channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    [p], [d] = cluster.prefill, cluster.decode
    await rendezvous(channel, "t")
    await p.expect("peer")
    order = await p.expect("order")

    st = await transfers(channel).Cancel(pb.CancelRequest(transfer_id="t", reason="abort"))
    assert st.state == pb.TRANSFER_STATE_CANCELLED and st.write_may_land

    cancel = await p.expect("cancel_order")
    assert (cancel.order_id, cancel.transfer_id) == (order.order_id, "t")
    assert cancel.reason == pb.REASON_CANCELLED
    n = await d.expect("notice")
    assert n.state == pb.TRANSFER_STATE_CANCELLED and n.write_may_land is True

    await p.report_write(order, pb.WRITE_STATUS_DROPPED)
    n = await d.expect("notice")
    assert n.state == pb.TRANSFER_STATE_CANCELLED and n.write_may_land is False
    st = await get(channel, "t")
    assert st.state == pb.TRANSFER_STATE_CANCELLED and not st.write_may_land
    assert st.ranks[0].state == pb.RANK_STATE_DROPPED


@pytest.mark.parametrize("graceful", [True, False], ids=["half-close", "cancel"])
async def test_a_stream_that_closes_mid_transfer_fails_it(
    make_coord: MakeCoord, graceful: bool
) -> None:
    # The grace (the agent does not come back) ends well within the lease.
    coord = await make_coord(lease_s=1.0, heartbeat_interval_s=0.2, reconnect_grace_s=0.2)
    async with (
        grpc.aio.insecure_channel(coord.address) as ch,
        SimCluster(coord.address, auto_complete=False, heartbeat_interval=0.2) as c,
    ):
        [p], [d] = c.prefill, c.decode
        await rendezvous(ch, "t")
        await p.expect("peer")
        order = await p.expect("order")
        await p.report_write(order, pb.WRITE_STATUS_POSTED)
        await settle(p)

        await p.close(graceful=graceful)
        n = await d.expect("notice")
        assert n.transfer_id == "t" and n.state == pb.TRANSFER_STATE_FAILED
        assert n.reason == pb.REASON_AGENT_LOST
        # The posted WRITE may still land until the lost agent's lease is over ...
        assert n.write_may_land is True
        st = await get(ch, "t")
        assert st.state == pb.TRANSFER_STATE_FAILED and st.reason == pb.REASON_AGENT_LOST
        # ... after which the decode side may reuse the blocks.
        n = await d.expect("notice", timeout=WAIT, skip=("peer_fenced",))
        assert n.transfer_id == "t" and n.write_may_land is False
        st = await get(ch, "t")
        assert st.ranks[0].state == pb.RANK_STATE_FAILED


async def test_two_prefill_ranks_write_into_two_decode_ranks(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    async with SimCluster(coord.address, tp_size=2, auto_complete=False) as c:
        await rendezvous(channel, "t")
        orders = {}
        for p in c.prefill:
            peer = await p.expect("peer")
            assert peer.identity.tp_rank == p.rank
            assert peer.nixl_metadata == c.decode[p.rank].hello.hello.nixl_metadata
            o = await p.expect("order")
            assert o.prefill_rank == p.rank
            assert [t.decode_rank for t in o.targets] == [p.rank]
            orders[p.rank] = o

        await finish(c.prefill[0], c.decode[0], orders[0])
        await settle(c.prefill[0], c.decode[0])
        st = await get(channel, "t")
        assert st.state == pb.TRANSFER_STATE_WRITING and list(st.outstanding_ranks) == [1]

        await finish(c.prefill[1], c.decode[1], orders[1])
        st = (await wait_terminal(channel, ["t"]))["t"]
        assert st.state == pb.TRANSFER_STATE_COMPLETE and not st.write_may_land
        assert list(st.outstanding_ranks) == []
        assert [(r.prefill_rank, r.state, r.arrived) for r in st.ranks] == [
            (0, pb.RANK_STATE_DONE, True),
            (1, pb.RANK_STATE_DONE, True),
        ]


async def test_arrival_for_a_rank_that_does_not_write_here_is_ignored(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    async with SimCluster(coord.address, tp_size=2, auto_complete=False) as c:
        await rendezvous(channel, "t")
        await c.prefill[0].expect("peer")
        o = await c.prefill[0].expect("order")
        await c.prefill[0].report_write(o, pb.WRITE_STATUS_DONE)
        # Rank 1 never writes into decode rank 0: rejected, the stream survives.
        await c.decode[0].report_arrival("t", [1])
        await settle(c.decode[0])
        st = await get(channel, "t")
        assert not any(r.arrived for r in st.ranks)
        assert st.state == pb.TRANSFER_STATE_ORDERED


# ---------------------------------------------------------------- incarnations


async def test_a_new_prefill_incarnation_fences_the_old_one(
    coord: Coordinator, channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    [p], [d] = cluster.prefill, cluster.decode
    await rendezvous(channel, "t")
    await p.expect("peer")
    order = await p.expect("order")

    async with SimAgent(coord.address, "p0", "prefill", incarnation="i2") as p2:
        assert await p.expect_end() == grpc.StatusCode.OK  # the old stream is closed
        n = await d.expect("notice")
        assert n.state == pb.TRANSFER_STATE_FAILED and n.reason == pb.REASON_AGENT_FENCED
        assert n.write_may_land is True  # i1 may still post until its lease ends
        st = await get(channel, "t")
        assert st.state == pb.TRANSFER_STATE_FAILED and st.reason == pb.REASON_AGENT_FENCED
        assert st.ranks[0].order_id == order.order_id

        # The new incarnation hears that "t" failed, gets new work (and PeerInfo
        # again), but never the old order.
        n = await p2.expect("notice")
        assert (n.transfer_id, n.reason) == ("t", pb.REASON_AGENT_FENCED)
        await rendezvous(channel, "t2")
        await p2.expect("peer")
        o2 = await p2.expect("order")
        assert o2.transfer_id == "t2" and o2.prefill_incarnation == "i2"
        await finish(p2, d, o2)
        done = await wait_terminal(channel, ["t2"])
        assert done["t2"].state == pb.TRANSFER_STATE_COMPLETE


async def test_a_new_decode_incarnation_sends_peer_fenced_to_its_writers(
    coord: Coordinator, channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    [p], [d] = cluster.prefill, cluster.decode
    await rendezvous(channel, "t")
    await p.expect("peer")
    order = await p.expect("order")

    async with SimAgent(coord.address, "d0", "decode", incarnation="i2") as d2:
        assert await d.expect_end() == grpc.StatusCode.OK
        got = {}
        for _ in range(3):
            msg = await p.next()
            kind = msg.WhichOneof("kind")
            assert kind is not None, msg
            got[kind] = getattr(msg, kind)
        assert set(got) == {"cancel_order", "notice", "peer_fenced"}
        assert got["cancel_order"].order_id == order.order_id
        assert got["notice"].reason == pb.REASON_AGENT_FENCED
        fenced = got["peer_fenced"]
        assert (fenced.engine_id, fenced.tp_rank, fenced.incarnation) == ("d0", 0, "i1")
        st = await get(channel, "t")
        assert st.state == pb.TRANSFER_STATE_FAILED and st.reason == pb.REASON_AGENT_FENCED

        # The prefill rank learns the new decode incarnation before writing to it.
        await rendezvous(channel, "t2")
        peer = await p.expect("peer")
        assert peer.identity.incarnation == "i2"
        assert peer.nixl_metadata == d2.hello.hello.nixl_metadata
        o2 = await p.expect("order")
        assert o2.targets[0].decode_incarnation == "i2"


async def test_heartbeats_are_acked_with_the_lease(cluster: SimCluster) -> None:
    [p] = cluster.prefill
    ack = await p.heartbeat()
    assert ack is not None and ack.lease_ms == 5000
    assert p.welcome is not None and p.welcome.heartbeat_interval_ms == 1000


# ---------------------------------------------------------------- status service


async def test_list_transfers_filters_by_state_engine_and_limit(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    async with SimCluster(coord.address, auto_complete=True):
        await transfers(channel).RegisterDecodeBlocks(decode_req("a-registered", [1]))
        await transfers(channel).ReportPrefillDone(prefill_req("b-prefilled", [1, 2, 3]))
        await rendezvous(channel, "c-complete")
        done = await wait_terminal(channel, ["c-complete"])
        assert done["c-complete"].state == pb.TRANSFER_STATE_COMPLETE
        await transfers(channel).RegisterDecodeBlocks(decode_req("d-cancelled", [2]))
        await transfers(channel).Cancel(pb.CancelRequest(transfer_id="d-cancelled"))

        async def ids(**kw: Any) -> tuple[list[str], int]:
            r = await status(channel).ListTransfers(pb.ListTransfersRequest(**kw))
            return [t.transfer_id for t in r.transfers], r.total_matching

        everything = ["d-cancelled", "c-complete", "b-prefilled", "a-registered"]
        assert await ids() == (everything, 4)  # newest first
        assert await ids(states=[pb.TRANSFER_STATE_REGISTERED]) == (["a-registered"], 1)
        assert await ids(states=[pb.TRANSFER_STATE_COMPLETE, pb.TRANSFER_STATE_CANCELLED]) == (
            ["d-cancelled", "c-complete"],
            2,
        )
        assert await ids(engine_id="p0") == (["c-complete", "b-prefilled"], 2)
        assert await ids(engine_id="d0") == (["d-cancelled", "c-complete", "a-registered"], 3)
        assert await ids(engine_id="nobody") == ([], 0)
        assert await ids(limit=2) == (everything[:2], 4)
        assert await ids(engine_id="d0", states=[pb.TRANSFER_STATE_REGISTERED], limit=5) == (
            ["a-registered"],
            1,
        )
        assert await ids(min_age_ms=3_600_000) == ([], 0)

        err = await rpc_error(
            status(channel).ListTransfers(
                pb.ListTransfersRequest(states=[pb.TransferState.ValueType(99)])
            )
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_details(err).startswith("states:")


async def _next_event(
    call: grpc.aio.UnaryStreamCall[pb.WatchTransfersRequest, pb.TransferEvent],
) -> pb.TransferStatus:
    ev = await asyncio.wait_for(call.read(), WAIT)
    assert isinstance(ev, pb.TransferEvent), ev  # not grpc.aio.EOF: the stream goes on
    return ev.transfer


async def test_watch_streams_every_state_change(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    async with SimCluster(coord.address, auto_complete=True):
        await transfers(channel).RegisterDecodeBlocks(decode_req("w0", [5]))
        req = pb.WatchTransfersRequest(engine_id="d0", include_existing=True)
        call = status(channel).WatchTransfers(req)
        try:
            # The replay of an existing transfer proves the watch is registered.
            assert (await _next_event(call)).transfer_id == "w0"
            await rendezvous(channel, "w1")
            seen: list[pb.TransferState.ValueType] = []
            while not seen or seen[-1] not in TERMINAL:
                t = await _next_event(call)
                assert t.transfer_id == "w1"
                seen.append(t.state)
            assert seen[0] == pb.TRANSFER_STATE_REGISTERED
            assert pb.TRANSFER_STATE_ORDERED in seen
            assert seen[-1] == pb.TRANSFER_STATE_COMPLETE
            assert seen == sorted(seen)  # states only move forward
        finally:
            call.cancel()


async def test_watch_replays_existing_then_filters_new_events(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    async with SimCluster(coord.address, auto_complete=True):
        await rendezvous(channel, "old")
        done = await wait_terminal(channel, ["old"])
        assert done["old"].state == pb.TRANSFER_STATE_COMPLETE
        await transfers(channel).RegisterDecodeBlocks(decode_req("waiting", [5]))

        req = pb.WatchTransfersRequest(states=[pb.TRANSFER_STATE_COMPLETE], include_existing=True)
        call = status(channel).WatchTransfers(req)
        try:
            first = await _next_event(call)  # replayed: the watch is registered from here
            assert (first.transfer_id, first.state) == ("old", pb.TRANSFER_STATE_COMPLETE)
            await transfers(channel).RegisterDecodeBlocks(decode_req("skipped", [6]))
            await rendezvous(channel, "new")
            nxt = await _next_event(call)
            # Neither "waiting" nor the REGISTERED "skipped" match; only completions do.
            assert (nxt.transfer_id, nxt.state) == ("new", pb.TRANSFER_STATE_COMPLETE)
        finally:
            call.cancel()

        # Without a state filter the replay holds live and retained terminal
        # transfers alike, oldest first (the proto's include_existing).
        call = status(channel).WatchTransfers(pb.WatchTransfersRequest(include_existing=True))
        try:
            replayed = [await _next_event(call) for _ in range(4)]
        finally:
            call.cancel()
        assert [(t.transfer_id, t.state) for t in replayed] == [
            ("old", pb.TRANSFER_STATE_COMPLETE),
            ("waiting", pb.TRANSFER_STATE_REGISTERED),
            ("skipped", pb.TRANSFER_STATE_REGISTERED),
            ("new", pb.TRANSFER_STATE_COMPLETE),
        ]

        err = await rpc_error(
            status(channel)
            .WatchTransfers(pb.WatchTransfersRequest(states=[pb.TransferState.ValueType(42)]))
            .read()
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_list_engines_shows_ranks_leases_and_connection(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    async with SimCluster(coord.address, tp_size=2, auto_complete=False) as c:
        await transfers(channel).RegisterDecodeBlocks(decode_req("a", [1]))
        await rendezvous(channel, "b")
        await c.prefill[1].expect("peer")
        await c.prefill[1].expect("order")

        r = await status(channel).ListEngines(pb.ListEnginesRequest())
        by_id = {e.engine_id: e for e in r.engines}
        assert [e.engine_id for e in r.engines] == ["d0", "p0"]
        d, p = by_id["d0"], by_id["p0"]
        assert (d.role, p.role) == (pb.ROLE_DECODE, pb.ROLE_PREFILL)
        assert d.tp_size == p.tp_size == 2 and d.ready and p.ready
        assert d.tokens_per_block == 16
        assert (d.inflight_transfers, p.inflight_transfers) == (2, 1)
        for e in (d, p):
            assert [lease.tp_rank for lease in e.ranks] == [0, 1]
            for lease in e.ranks:
                assert lease.connected and lease.incarnation == "i1"
                assert lease.nixl_agent_name == f"{e.engine_id}-{lease.tp_rank}-i1"
                assert lease.lease_expires_unix_us > lease.last_seen_unix_us > 0
        assert [lease.inflight_orders for lease in p.ranks] == [1, 1]

        only = await status(channel).ListEngines(pb.ListEnginesRequest(role=pb.ROLE_PREFILL))
        assert [e.engine_id for e in only.engines] == ["p0"]

        await c.prefill[1].close(graceful=True)
        await settle(c.prefill[0])
        # The stream is gone but the lease holds: listed, not connected, and
        # not ready once the rank's reconnect grace is over (1 s, within the
        # 5 s lease; within the grace it stays ready: tests/test_rendezvous.py).
        deadline = time.monotonic() + WAIT
        while True:
            r = await status(channel).ListEngines(pb.ListEnginesRequest(role=pb.ROLE_PREFILL))
            [p] = r.engines
            assert [lease.connected for lease in p.ranks] == [True, False]
            # Ready exactly while the rank is within its grace (shown `returning`).
            assert [lease.returning for lease in p.ranks] == [False, p.ready]
            if not p.ready:
                break
            assert time.monotonic() < deadline, "still ready past the grace"
            await asyncio.sleep(0.05)  # polling the operator API under a deadline


# ---------------------------------------------------------------- errors


async def _stream_status(
    channel: grpc.aio.Channel, *msgs: pb.AgentMessage
) -> tuple[grpc.StatusCode, str]:
    call = pbg.AgentServiceStub(channel).AgentStream(iter(msgs))
    code = await asyncio.wait_for(call.code(), WAIT)
    return code, await call.details()


async def test_agent_stream_rejects_a_bad_first_message(channel: grpc.aio.Channel) -> None:
    beat = pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1))
    code, details = await _stream_status(channel, beat)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "hello" in details

    code, details = await _stream_status(channel)  # no message at all
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    old = hello("p0", "prefill", protocol_version=PROTOCOL_VERSION + 1)
    code, details = await _stream_status(channel, old)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.startswith("hello.protocol_version:")

    bad = hello("p0", "prefill")
    bad.hello.layout.regions[0].block_len = 0
    code, details = await _stream_status(channel, bad)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("layout.regions[0]")

    bad = hello("p0", "prefill", rank=2, tp_size=2)
    code, details = await _stream_status(channel, bad)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("identity.tp_rank")

    no_role = hello("p0", pb.ROLE_UNSPECIFIED)
    code, details = await _stream_status(channel, no_role)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("identity.role")


async def test_register_from_an_unknown_engine_is_a_failed_precondition(
    channel: grpc.aio.Channel,
) -> None:
    err = await rpc_error(transfers(channel).RegisterDecodeBlocks(decode_req("t", [1])))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_details(err).startswith("decode_engine_id:")
    err = await rpc_error(transfers(channel).ReportPrefillDone(prefill_req("t", [1, 2, 3])))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_side_whose_engine_has_no_agents_ends_the_transfer_at_once(
    channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    """A prefill report from an engine with no registered agents (its agents
    not back yet after a coordinator restart) is refused, and the engine frees
    its blocks on that answer: the transfer ends FAILED with it, so the decode
    side learns now instead of holding its blocks until the rendezvous
    deadline (60 s). An id not seen yet is recorded ended, for the other side."""
    [d] = cluster.decode
    st = await transfers(channel).RegisterDecodeBlocks(decode_req("x", [7, 8]))
    assert st.state == pb.TRANSFER_STATE_REGISTERED
    err = await rpc_error(
        transfers(channel).ReportPrefillDone(prefill_req("x", [1, 2], engine="p9"))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no registered agents" in error_details(err)
    n = await d.expect("notice")
    assert (n.transfer_id, n.state, n.write_may_land) == ("x", pb.TRANSFER_STATE_FAILED, False)
    got = await status(channel).GetTransfer(pb.GetTransferRequest(transfer_id="x"))
    assert (got.state, got.reason) == (pb.TRANSFER_STATE_FAILED, pb.REASON_AGENT_LOST)
    assert got.detail.startswith("the prefill report was refused: prefill_engine_id:"), got.detail

    # The refused side first: the decode registration that follows is told.
    err = await rpc_error(
        transfers(channel).ReportPrefillDone(prefill_req("y", [1, 2], engine="p9"))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    st = await transfers(channel).RegisterDecodeBlocks(decode_req("y", [7, 8]))
    assert (st.state, st.write_may_land) == (pb.TRANSFER_STATE_FAILED, False)
    n = await d.expect("notice")
    assert (n.transfer_id, n.state) == ("y", pb.TRANSFER_STATE_FAILED)

    # Not another engine's transfer: one begun with p0 as its prefill side
    # stays live when p9 reports for it.
    begin = pb.BeginTransferRequest(transfer_id="z", prefill_engine_id="p0", decode_engine_id="d0")
    await transfers(channel).BeginTransfer(begin)
    err = await rpc_error(
        transfers(channel).ReportPrefillDone(prefill_req("z", [1, 2], engine="p9"))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    got = await status(channel).GetTransfer(pb.GetTransferRequest(transfer_id="z"))
    assert got.state == pb.TRANSFER_STATE_AWAITING


async def test_wrong_role_and_bad_blocks_name_the_field(
    channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    err = await rpc_error(
        transfers(channel).RegisterDecodeBlocks(decode_req("t", [1], engine="p0"))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_details(err).startswith("decode_engine_id:")
    for ids, field in (([1, 1], "block_ids[0]"), ([5000], "block_ids[0]")):
        err = await rpc_error(transfers(channel).RegisterDecodeBlocks(decode_req("t", ids)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_details(err).startswith(field + ":"), error_details(err)
    err = await rpc_error(transfers(channel).RegisterDecodeBlocks(decode_req("a b", [1])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(err).startswith("transfer_id:")


async def test_unknown_transfer_is_not_found(channel: grpc.aio.Channel) -> None:
    err = await rpc_error(status(channel).GetTransfer(pb.GetTransferRequest(transfer_id="nope")))
    assert err.code() == grpc.StatusCode.NOT_FOUND


async def test_begin_transfer_is_idempotent_and_conflicts_are_rejected(
    channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    req = pb.BeginTransferRequest(transfer_id="b", prefill_engine_id="p0", decode_engine_id="d0")
    st = await transfers(channel).BeginTransfer(req)
    assert st.state == pb.TRANSFER_STATE_AWAITING
    assert same_status(await transfers(channel).BeginTransfer(req), st)
    other = pb.BeginTransferRequest(transfer_id="b", prefill_engine_id="p0")
    err = await rpc_error(transfers(channel).BeginTransfer(other))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    err = await rpc_error(
        transfers(channel).RegisterDecodeBlocks(
            pb.RegisterDecodeBlocksRequest(
                transfer_id="b", decode_engine_id="p0", block_ids=blocks([1]), num_tokens=16
            )
        )
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_the_inflight_cap_is_resource_exhausted(make_coord: MakeCoord) -> None:
    coord = await make_coord(max_inflight=2)
    async with (
        grpc.aio.insecure_channel(coord.address) as ch,
        SimCluster(coord.address, auto_complete=False),
    ):
        await transfers(ch).RegisterDecodeBlocks(decode_req("a", [1]))
        await transfers(ch).RegisterDecodeBlocks(decode_req("b", [2]))
        err = await rpc_error(transfers(ch).RegisterDecodeBlocks(decode_req("c", [3])))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Retries of admitted transfers still succeed at the cap.
        again = await transfers(ch).RegisterDecodeBlocks(decode_req("a", [1]))
        assert again.state == pb.TRANSFER_STATE_REGISTERED
        await transfers(ch).Cancel(pb.CancelRequest(transfer_id="a"))
        st = await transfers(ch).RegisterDecodeBlocks(decode_req("c", [3]))
        assert st.state == pb.TRANSFER_STATE_REGISTERED


async def test_graceful_stop_reports_not_serving_and_ends_streams(
    make_coord: MakeCoord,
) -> None:
    coord = await make_coord()
    async with grpc.aio.insecure_channel(coord.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pushkv.v1.TransferService", "pushkv.v1.AgentService"):
            r = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        agent = SimAgent(coord.address, "p0", "prefill")
        await agent.start()
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        first = await asyncio.wait_for(watch.read(), WAIT)
        assert first.status == health_pb2.HealthCheckResponse.SERVING

        stopping = asyncio.ensure_future(coord.stop(1.0))
        nxt = await asyncio.wait_for(watch.read(), WAIT)
        assert nxt.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        await asyncio.wait_for(stopping, WAIT)
        assert await agent.expect_end() is not None
        await agent.close()

        err = await rpc_error(health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2))
        assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
