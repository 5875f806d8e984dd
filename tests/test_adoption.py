"""A new leader adopting transfers from the agents' hellos (controlplane/adoption.py),
driven directly with a fake clock (no gRPC), in the style of test_rendezvous.py."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from pushkv.controlplane.clock import FakeClock
from pushkv.controlplane.domain import (
    AgentKey,
    Effect,
    EngineId,
    HeldTransfer,
    RankState,
    Reason,
    Role,
    SendCancelOrder,
    State,
    WriteStatus,
)
from pushkv.controlplane.rendezvous import Rendezvous
from pushkv.controlplane.server import ServerSettings, start
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.transfer import Transfer
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimAgent, rendezvous, wait_terminal
from tests.test_rendezvous import D, P, notices, orders, reg


def leader(tp: int = 1, **kw: Any) -> tuple[Rendezvous, FakeClock]:
    """A fresh core: the new leader, before any agent said hello."""
    clock = FakeClock()
    return Rendezvous(CoreSettings(**kw), clock), clock


def hello(
    rv: Rendezvous, engine: EngineId, role: Role, rank: int, tp: int, *held: HeldTransfer
) -> list[Effect]:
    return rv.agent_hello(reg(engine, role, rank, tp), held, adopt=True)


def test_decode_registered_only_completes_once_both_sides_come_back() -> None:
    rv, _ = leader()
    hello(rv, P, Role.PREFILL, 0, 1)
    hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("t"))
    t = rv.get("t")
    assert (t.state, t.adopting, t.decode_engine) == (State.AWAITING, True, D)
    assert rv.inflight == 1 and rv.inflight_for(D) == 1
    rv.register_decode("t", D, [[5, 6]], 20)  # resubmitted
    _, effects = rv.prefill_done("t", P, [[1, 2]], 20)
    [o] = orders(effects)  # the one order, of this leader
    assert o.order.order_id.startswith(rv.coordinator_id) and not t.adopting
    rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.DONE)
    rv.arrival_report(AgentKey(D, 0), "i1", "t", [0])
    assert t.state is State.COMPLETE


def test_a_posted_order_is_never_ordered_again_and_its_report_completes_it() -> None:
    rv, _ = leader()
    hello(rv, P, Role.PREFILL, 0, 1, HeldTransfer("t", posted=("old-7",)))
    hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("t"))
    t = rv.get("t")
    assert t.orders[0].state is RankState.POSTED and t.orders[0].adopted
    assert t.write_may_land  # a WRITE of the old leader may still land
    # Its DONE lands before the sides come back: recorded, nothing ordered.
    assert orders(rv.write_report(AgentKey(P, 0), "i1", "old-7", "t", WriteStatus.DONE)) == []
    rv.arrival_report(AgentKey(D, 0), "i1", "t", [0])  # kept until the transfer is ordered
    rv.register_decode("t", D, [[5, 6]], 20)
    _, effects = rv.prefill_done("t", P, [[1, 2]], 20)
    assert orders(effects) == []
    assert t.state is State.COMPLETE and t.reason is Reason.NONE
    assert t.orders[0].order.order_id == "old-7" and t.orders[0].order.targets


def test_tp2_posted_rank_kept_unposted_rank_ordered_once_counted_rank_written() -> None:
    rv, _ = leader()
    # Rank 0 posted, rank 1 held its order unposted (refused by the term fence).
    hello(rv, P, Role.PREFILL, 0, 2, HeldTransfer("t", posted=("old-1",)))
    hello(rv, P, Role.PREFILL, 1, 2, HeldTransfer("t", unposted=("old-2",)))
    hello(rv, D, Role.DECODE, 0, 2, HeldTransfer("t"))
    hello(rv, D, Role.DECODE, 1, 2, HeldTransfer("t"))
    rv.register_decode("t", D, [[5, 6]], 20)
    t, effects = rv.prefill_done("t", P, [[1, 2]], 20)
    [o] = orders(effects)
    assert o.to == AgentKey(P, 1) and o.order.order_id != "old-2"
    assert t.orders[0].order.order_id == "old-1"
    # A second hello of each agent (a reconnect) changes nothing and replays
    # only this leader's order, never the adopted one.
    again = hello(rv, P, Role.PREFILL, 0, 2, HeldTransfer("t", posted=("old-1",)))
    assert orders(again) == []
    replay = hello(rv, P, Role.PREFILL, 1, 2, HeldTransfer("t", unposted=("old-2",)))
    assert [x.order.order_id for x in orders(replay)] == [o.order.order_id]
    rv.write_report(AgentKey(P, 0), "i1", "old-1", "t", WriteStatus.DONE)
    rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.DONE)
    rv.arrival_report(AgentKey(D, 0), "i1", "t", [0])
    rv.arrival_report(AgentKey(D, 1), "i1", "t", [1])
    assert t.state is State.COMPLETE


def test_a_rank_decode_counted_is_written_and_never_ordered() -> None:
    rv, _ = leader()
    # Prefill rank 0 finished and freed before the kill (it re-sends nothing);
    # decode counted its notification. Rank 1 still holds its blocks.
    hello(rv, P, Role.PREFILL, 0, 2)
    hello(rv, P, Role.PREFILL, 1, 2, HeldTransfer("t"))
    hello(rv, D, Role.DECODE, 0, 2, HeldTransfer("t", counted=(0,)))
    hello(rv, D, Role.DECODE, 1, 2, HeldTransfer("t"))
    rv.register_decode("t", D, [[5, 6]], 20)
    t, effects = rv.prefill_done("t", P, [[1, 2]], 20)
    [o] = orders(effects)
    assert o.to == AgentKey(P, 1)
    assert t.orders[0].state is RankState.DONE and t.arrived[0] == {0}
    rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.DONE)
    rv.arrival_report(AgentKey(D, 1), "i1", "t", [1])
    assert t.state is State.COMPLETE


def test_tp2_written_before_the_failover_is_complete_and_its_sides_answered_so() -> None:
    """Every decode rank was told KV_READY before the kill (its hello says
    `ready`); prefill wrote, freed its blocks and re-sends nothing. The
    scheduler clients still had both sides open: they are answered COMPLETE,
    never FAILED, and nothing is ordered."""
    rv, _ = leader()
    rv.lead()
    hello(rv, P, Role.PREFILL, 0, 2)
    hello(rv, P, Role.PREFILL, 1, 2)
    hello(rv, D, Role.DECODE, 0, 2, HeldTransfer("t", counted=(0,), ready=True))
    t = rv.get("t")
    assert (t.state, t.adopting) == (State.AWAITING, True)  # one rank is not enough
    effects = hello(rv, D, Role.DECODE, 1, 2, HeldTransfer("t", counted=(1,), ready=True))
    assert t.state is State.COMPLETE and t.reason is Reason.NONE, t.detail
    assert "written before the failover" in t.detail
    assert orders(effects) == [] and notices(effects) == []  # every rank knows already
    assert "written_before_failover" in [s for s, _, _ in t.timeline]
    assert rv.inflight == 0 and rv.inflight_for(D) == 0
    t2, effects = rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    assert t2.state is State.COMPLETE and effects == []
    t2, effects = rv.prefill_done("t", P, [[1, 2]], 20, resubmitted=True)
    assert t2.state is State.COMPLETE and orders(effects) == []


def test_ready_on_some_ranks_only_adopts_them_as_written() -> None:
    """Control: decode rank 1 still misses a writer (not ready), so the
    transfer is adopted, not complete; rank 0's writer is counted as written
    and only rank 1 is ordered."""
    rv, _ = leader()
    rv.lead()
    hello(rv, P, Role.PREFILL, 0, 2)
    hello(rv, P, Role.PREFILL, 1, 2, HeldTransfer("t"))
    hello(rv, D, Role.DECODE, 0, 2, HeldTransfer("t", counted=(0,), ready=True))
    hello(rv, D, Role.DECODE, 1, 2, HeldTransfer("t"))
    t = rv.get("t")
    assert (t.state, t.adopting) == (State.AWAITING, True)
    rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    t, effects = rv.prefill_done("t", P, [[1, 2]], 20, resubmitted=True)
    [o] = orders(effects)
    assert o.to == AgentKey(P, 1) and t.orders[0].state is RankState.DONE
    rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.DONE)
    rv.arrival_report(AgentKey(D, 1), "i1", "t", [1])
    assert t.state is State.COMPLETE and "written before" not in t.detail


def test_ready_for_a_transfer_this_leader_ordered_changes_nothing() -> None:
    """A reconnect to the same leader re-sends `ready` items: a transfer it
    ordered itself completes by its reports, as without the flag."""
    rv, _ = leader()
    hello(rv, P, Role.PREFILL, 0, 1)
    hello(rv, D, Role.DECODE, 0, 1)
    rv.register_decode("t", D, [[5, 6]], 20)
    t, effects = rv.prefill_done("t", P, [[1, 2]], 20)
    [o] = orders(effects)
    assert hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("t", counted=(0,), ready=True))
    assert (t.state, t.adopting) == (State.ORDERED, False)
    rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.DONE)
    assert t.state is State.COMPLETE and "written before" not in t.detail


def replayed_before_any_hello(rv: Rendezvous, arrival_from: AgentKey) -> Transfer:
    """TP 2: prefill rank 0 wrote, freed its blocks and re-sends nothing; decode
    rank 0 was told, holds nothing and only replays its arrival, which reaches
    the new leader before any hello names the transfer. Then the ranks that
    still hold it say hello, and both sides come back."""
    hello(rv, P, Role.PREFILL, 0, 2)
    hello(rv, D, Role.DECODE, 0, 2)
    hello(rv, EngineId("other"), Role.DECODE, 0, 2)
    rv.arrival_report(arrival_from, "i1", "t", [0])
    hello(rv, P, Role.PREFILL, 1, 2, HeldTransfer("t"))
    hello(rv, D, Role.DECODE, 1, 2, HeldTransfer("t"))
    rv.register_decode("t", D, [[5, 6]], 20)
    t, effects = rv.prefill_done("t", P, [[1, 2]], 20)
    for o in orders(effects):
        rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.DONE)
    rv.arrival_report(AgentKey(D, 1), "i1", "t", [1])
    return t


def test_tp2_an_arrival_replayed_before_any_hello_names_the_transfer_is_counted() -> None:
    """Kept within the rebuild window and counted when the transfer is ordered:
    rank 0 is not ordered again (its blocks are gone) and the transfer
    completes with one WRITE per rank in all."""
    rv, _ = leader()
    rv.lead()
    t = replayed_before_any_hello(rv, AgentKey(D, 0))
    assert t.orders[0].state is RankState.DONE and t.orders[0].adopted
    assert [r for r, o in t.orders.items() if not o.adopted] == [1]  # ordered here: rank 1
    assert t.state is State.COMPLETE, t.detail


def test_an_early_arrival_counts_only_from_the_decode_engine_and_within_the_window() -> None:
    # Another engine's rank names the transfer: never counted, rank 0 ordered.
    rv, _ = leader()
    rv.lead()
    t = replayed_before_any_hello(rv, AgentKey(EngineId("other"), 0))
    assert not t.orders[0].adopted and t.state is not State.COMPLETE
    # After the rebuild window the leader keeps nothing: as without a failover.
    rv, clock = leader()
    rv.lead()
    clock.advance(rv.settings.rebuild_window_s)
    rv.tick()
    t = replayed_before_any_hello(rv, AgentKey(D, 0))
    assert not t.orders[0].adopted
    # A coordinator that did not take over (no lead()) keeps nothing either.
    rv, _ = leader()
    t = replayed_before_any_hello(rv, AgentKey(D, 0))
    assert not t.orders[0].adopted


def test_nobody_brings_the_blocks_back_it_expires_and_both_engines_are_told() -> None:
    rv, clock = leader(rendezvous_timeout_s=10.0)
    hello(rv, P, Role.PREFILL, 0, 1, HeldTransfer("t", posted=("old-7",)))
    hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("t"))
    for _ in range(3):  # the agents heartbeat meanwhile
        clock.advance(3.5)
        assert rv.agent_seen(AgentKey(P, 0), "i1") and rv.agent_seen(AgentKey(D, 0), "i1")
        effects = rv.tick()
    t = rv.get("t")
    assert t.state is State.EXPIRED
    [n] = notices(effects, AgentKey(D, 0))
    assert n.notice.write_may_land  # the old WRITE may still land: decode waits
    assert [e.order_id for e in effects if isinstance(e, SendCancelOrder)] == ["old-7"]
    effects = rv.write_report(AgentKey(P, 0), "i1", "old-7", "t", WriteStatus.DONE)
    [n] = notices(effects, AgentKey(D, 0))
    assert not n.notice.write_may_land  # released: decode may reuse its blocks
    assert rv.inflight == 0 and rv.inflight_for(D) == 0 and rv.inflight_for(P) == 0


def test_an_adopted_order_that_fails_fails_the_transfer_cleanly() -> None:
    rv, _ = leader()
    hello(rv, P, Role.PREFILL, 0, 1, HeldTransfer("t", posted=("old-7",)))
    hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("t"))
    effects = rv.write_report(AgentKey(P, 0), "i1", "old-7", "t", WriteStatus.FAILED, "boom")
    t = rv.get("t")
    assert t.state is State.FAILED and t.reason is Reason.WRITE_FAILED
    [n] = notices(effects, AgentKey(D, 0))
    assert not n.notice.write_may_land and "older leader" in n.notice.detail
    # The resubmitted sides learn it ended; nothing is ordered.
    _, effects = rv.register_decode("t", D, [[5, 6]], 20)
    assert orders(effects) == []


def test_a_transfer_ended_here_is_told_again_and_another_engines_is_ignored() -> None:
    rv, _ = leader()
    hello(rv, P, Role.PREFILL, 0, 1)
    hello(rv, D, Role.DECODE, 0, 1)
    rv.cancel("gone", "router cancelled")
    effects = hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("gone"))
    [n] = notices(effects, AgentKey(D, 0))
    assert n.notice.state is State.CANCELLED and not n.notice.write_may_land
    # A transfer this leader pairs with another decode engine is not D2's.
    hello(rv, EngineId("decode-2"), Role.DECODE, 0, 1)
    rv.register_decode("other", D, [[1]], 10)
    assert hello(rv, EngineId("decode-2"), Role.DECODE, 0, 1, HeldTransfer("other")) == []
    assert rv.get("other").decode_engine == D and not rv.get("other").adopting
    # A malformed id is skipped, the hello is not refused.
    assert hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("bad id|x")) == []


def test_in_flight_limits_never_refuse_an_adoption() -> None:
    rv, _ = leader(max_inflight=1, max_inflight_per_engine=1)
    held = [HeldTransfer(f"t{i}") for i in range(3)]
    hello(rv, D, Role.DECODE, 0, 1, *held)
    assert rv.inflight == 3 and all(rv.get(f"t{i}").adopting for i in range(3))


def test_a_begin_retried_to_the_new_leader_agrees_with_the_adopted_engines() -> None:
    rv, _ = leader()
    hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("t"))
    t, _ = rv.begin("t", P, D)
    assert (t.announced_prefill, t.announced_decode) == (P, D) and t.adopting


# ---------------------------------------------------------------- over gRPC


async def test_over_grpc_an_order_posted_before_the_failover_completes_without_a_new_one() -> None:
    """The hello's transfers reach the core through the servicer (convert.held_from_pb)."""
    c = await start(ServerSettings(port=0))
    c.runtime.term = 9  # the new leader's
    p = SimAgent(c.address, "p0", "prefill")
    p.hello.hello.term = 8  # it followed the old leader
    p.hello.hello.held.add(transfer_id="t", posted_order_ids=["old-1"])
    d = SimAgent(c.address, "d0", "decode")
    d.hello.hello.term = 8
    d.hello.hello.held.add(transfer_id="t")
    try:
        await p.start()
        await d.start()
        async with grpc.aio.insecure_channel(c.address) as ch:
            st = pbg.StatusServiceStub(ch)
            t = await st.GetTransfer(pb.GetTransferRequest(transfer_id="t"))
            assert t.state == pb.TRANSFER_STATE_AWAITING
            assert [e.stage for e in t.timeline] == ["adopted", "adopted"]
            await rendezvous(ch, "t", prefill_engine="p0", decode_engine="d0")  # sides again
            old = pb.TransferOrder(order_id="old-1", transfer_id="t")
            await p.report_write(old, pb.WRITE_STATUS_DONE)
            await d.report_arrival("t", [0])
            final = (await wait_terminal(ch, ["t"]))["t"]
            assert final.state == pb.TRANSFER_STATE_COMPLETE
        await p.heartbeat()  # everything sent to p before the ack has been read
        assert p.orders_seen == []  # rank 0 was written by the old leader's order
    finally:
        await p.close()
        await d.close()
        await c.stop(0)


async def test_over_grpc_a_tell_only_hello_is_never_adopted_an_ended_transfer_is_told() -> None:
    """An agent that does not rebuild (AgentHello.held_tell_only) re-sends its
    transfers only to be told of those that ended: a newer leader adopts none."""
    c = await start(ServerSettings(port=0))
    c.runtime.term = 9
    d = SimAgent(c.address, "d0", "decode")
    d.hello.hello.term = 8  # it followed the old leader: adopted, were it rebuilding
    d.hello.hello.held.add(transfer_id="t-live")
    d.hello.hello.held.add(transfer_id="t-ended")
    d.hello.hello.held_tell_only = True
    try:
        async with grpc.aio.insecure_channel(c.address) as ch:
            stub = pbg.TransferServiceStub(ch)  # a tombstone: ended before the hello
            await stub.Cancel(pb.CancelRequest(transfer_id="t-ended", reason="test"))
            await d.start()
            notice = await d.expect("notice", skip=("peer",))
            assert notice.transfer_id == "t-ended" and not notice.write_may_land
            st = pbg.StatusServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await st.GetTransfer(pb.GetTransferRequest(transfer_id="t-live"))
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND  # not adopted
    finally:
        await d.close()
        await c.stop(0)
