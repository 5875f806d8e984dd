"""The rendezvous core, driven directly with a fake clock (no gRPC)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

from pushkv.controlplane.clock import FakeClock
from pushkv.controlplane.domain import (
    AgentKey,
    AgentNotBack,
    AgentRegistration,
    Effect,
    EngineId,
    HeldTransfer,
    KVLayout,
    KVRegion,
    RankState,
    Reason,
    Role,
    SendCancelOrder,
    SendNotice,
    SendOrder,
    SendPeerFenced,
    State,
    WriteStatus,
)
from pushkv.controlplane.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from pushkv.controlplane.rendezvous import Rendezvous
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.transfer import Transfer
from pushkv.controlplane.transfer_filter import TransferFilter
from pushkv.rules.block_groups import of

TPB = 16
P, D = EngineId("prefill-0"), EngineId("decode-0")


def reg(engine: str, role: Role, rank: int = 0, tp: int = 1, inc: str = "i1") -> AgentRegistration:
    layout = KVLayout(TPB, (KVRegion(0x1000, 4096, 64), KVRegion(0x100000, 4096, 64)))
    return AgentRegistration(
        EngineId(engine), role, rank, tp, inc, f"{engine}-{rank}-{inc}", b"md", layout
    )


def core(tp: int = 1, **kw: Any) -> tuple[Rendezvous, FakeClock]:
    """A core whose agents are lost at their lease, connected or not (as if
    every silent agent's connection were cut at once), unless the test gives
    `silent_agent_s`."""
    clock = FakeClock()
    kw.setdefault("silent_agent_s", 0.001)
    rv = Rendezvous(CoreSettings(**kw), clock)
    for r in range(tp):
        rv.agent_hello(reg(P, Role.PREFILL, r, tp))
        rv.agent_hello(reg(D, Role.DECODE, r, tp))
    return rv, clock


def orders(effects: Iterable[object]) -> list[SendOrder]:
    return [e for e in effects if isinstance(e, SendOrder)]


def notices(effects: Iterable[object], to: AgentKey | None = None) -> list[SendNotice]:
    return [e for e in effects if isinstance(e, SendNotice) and (to is None or e.to == to)]


def state_of(t: Transfer) -> State:
    """Read through a call, so mypy does not narrow the state across steps."""
    return t.state


def may_land(t: Transfer) -> bool:
    """Read through a call, so mypy does not narrow it across steps."""
    return t.write_may_land


def finish(rv: Rendezvous, o: SendOrder, inc: str = "i1") -> list[Effect]:
    out = rv.write_report(o.to, inc, o.order.order_id, o.order.transfer_id, WriteStatus.POSTED)
    out += rv.write_report(o.to, inc, o.order.order_id, o.order.transfer_id, WriteStatus.DONE)
    for tgt in o.order.targets:
        out += rv.arrival_report(
            AgentKey(tgt.decode_engine_id, tgt.decode_rank),
            "i1",
            o.order.transfer_id,
            [o.order.prefill_rank],
        )
    return out


@pytest.mark.parametrize("decode_first", [True, False])
def test_second_arrival_issues_exactly_one_order(decode_first: bool) -> None:
    rv, _ = core()
    first = (
        rv.register_decode("t1", D, [[5, 9, 2]], 40)
        if decode_first
        else rv.prefill_done("t1", P, [[1, 2, 3]], 40)
    )
    assert not orders(first[1])
    assert first[0].state is (State.REGISTERED if decode_first else State.PREFILL_DONE)
    second = (
        rv.prefill_done("t1", P, [[1, 2, 3]], 40)
        if decode_first
        else rv.register_decode("t1", D, [[5, 9, 2]], 40)
    )
    t, effects = second
    [o] = orders(effects)
    assert t.state is State.ORDERED
    assert o.to == AgentKey(P, 0)
    [tgt] = o.order.targets
    assert tgt.src_blocks == ((1, 2, 3),) and tgt.dst_blocks == ((5, 9, 2),)
    assert tgt.decode_engine_id == D and tgt.expected_writers == 1
    assert t.outstanding_ranks() == [0]
    assert t.write_may_land

    effects = finish(rv, o)
    assert state_of(t) is State.COMPLETE and not may_land(t)
    assert t.outstanding_ranks() == []
    # Both agents learned it themselves (DONE freed the source, the arrival
    # told the decode host): a clean COMPLETE sends no notice.
    assert notices(effects) == []


def test_timeline_takes_the_agents_stamps_bounded_by_start_and_arrival() -> None:
    rv, clock = core()
    rv.register_decode("t", D, [[5]], 16)
    begun = clock.wall()
    clock.advance(1.0)
    t, effects = rv.prefill_done("t", P, [[1]], 16)
    [o] = orders(effects)
    clock.advance(1.0)
    heard = clock.wall()
    oid = o.order.order_id
    # POSTED stamped 0.25 s before it was heard: recorded then.
    rv.write_report(o.to, "i1", oid, "t", WriteStatus.POSTED, at_unix=heard - 0.25)
    # DONE stamped by a clock ahead of the coordinator's: not after it was heard.
    rv.write_report(o.to, "i1", oid, "t", WriteStatus.DONE, at_unix=heard + 5.0)
    # An arrival stamped by a clock far behind: not before the transfer began.
    rv.arrival_report(AgentKey(D, 0), "i1", "t", [0], at_unix=begun - 60.0)
    stamps = {stage: at for stage, at, _ in t.timeline}
    assert stamps["write_posted"] == heard - 0.25
    assert stamps["write_done"] == heard
    assert stamps["arrived"] == begun == t.timeline[0][1]
    assert t.state is State.COMPLETE
    # No stamp sent (an older agent): the time it was heard.
    rv.register_decode("u", D, [[6]], 16)
    _, effects = rv.prefill_done("u", P, [[2]], 16)
    [o] = orders(effects)
    clock.advance(0.5)
    u = rv.write_report(o.to, "i1", o.order.order_id, "u", WriteStatus.POSTED)
    assert u and rv.get("u").timeline[-1] == ("write_posted", clock.wall(), 0)


def test_decode_prefix_hit_writes_only_the_tail() -> None:
    rv, _ = core()
    # 40 tokens = 3 blocks of 16; prefill has a 4th block for the sampled token.
    rv.prefill_done("t", P, [[10, 11, 12, 13]], 40)
    _, effects = rv.register_decode("t", D, [[7]], 40)
    [o] = orders(effects)
    assert o.order.targets[0].src_blocks == ((12,),)


def test_full_prefix_hit_completes_without_orders() -> None:
    rv, _ = core()
    rv.register_decode("t", D, [[]], 40)
    t, effects = rv.prefill_done("t", P, [[1, 2, 3]], 40)
    assert not orders(effects)
    assert t.state is State.COMPLETE and t.reason is Reason.NOTHING_TO_WRITE
    # No WRITE happened, so only a notice frees the prefill blocks and wakes decode.
    assert notices(effects, AgentKey(P, 0)) and notices(effects, AgentKey(D, 0))


def test_duplicates_are_idempotent_and_conflicts_rejected() -> None:
    rv, _ = core()
    t1, _ = rv.register_decode("t", D, [[1, 2]], 20)
    t2, e2 = rv.register_decode("t", D, [[1, 2]], 20)
    assert t1 is t2 and e2 == [] and t2.state is State.REGISTERED
    with pytest.raises(Conflict) as exc:
        rv.register_decode("t", D, [[1, 3]], 20)
    assert exc.value.field == "block_ids"
    with pytest.raises(Conflict) as exc:
        rv.register_decode("t", D, [[1, 2]], 21)
    assert exc.value.field == "num_tokens"
    _, e = rv.prefill_done("t", P, [[4, 5]], 20)
    assert len(orders(e)) == 1
    _, e = rv.prefill_done("t", P, [[4, 5]], 20)
    assert orders(e) == []  # a retry never issues a second order


def test_cancel_before_order_prevents_it() -> None:
    rv, _ = core()
    rv.register_decode("t", D, [[1]], 10)
    t, effects = rv.cancel("t", "client went away")
    assert t.state is State.CANCELLED and t.detail == "client went away"
    assert not t.write_may_land
    assert notices(effects, AgentKey(D, 0))[0].notice.write_may_land is False
    t, effects = rv.prefill_done("t", P, [[3]], 10)
    assert t.state is State.CANCELLED and orders(effects) == []


def test_cancel_of_unknown_transfer_leaves_a_tombstone() -> None:
    rv, _ = core()
    t, effects = rv.cancel("early", "")
    assert t.state is State.CANCELLED and notices(effects) == []  # no engine named yet
    t, effects = rv.register_decode("early", D, [[1]], 10)
    assert t.state is State.CANCELLED and orders(effects) == []
    # The late side's engine is told, like the engines a transfer names when it ends.
    [n] = notices(effects)
    assert n.to == AgentKey(D, 0) and n.incarnation == "i1"
    assert (n.notice.state, n.notice.reason, n.notice.write_may_land) == (
        State.CANCELLED,
        Reason.CANCELLED,
        False,
    )
    assert t.decode is None and t.timeline[-1][0] == "cancelled"  # the late side is not kept


@pytest.mark.parametrize("end", ["cancel", "expire"])
def test_a_side_arriving_after_the_end_tells_every_rank_of_its_engine(end: str) -> None:
    rv, clock = core(tp=2, rendezvous_timeout_s=5, lease_s=100)
    rv.register_decode("t", D, [[1]], 10)
    if end == "cancel":
        _, effects = rv.cancel("t", "client left")
        state, reason = State.CANCELLED, Reason.CANCELLED
    else:
        clock.advance(6)
        effects = rv.tick()
        state, reason = State.EXPIRED, Reason.DEADLINE
    # The end told the engine the transfer named: decode, every rank, once.
    assert sorted(n.to for n in notices(effects)) == [AgentKey(D, 0), AgentKey(D, 1)]
    t, effects = rv.prefill_done("t", P, [[3]], 10)
    assert t.state is state and orders(effects) == []
    told = notices(effects)
    assert sorted(n.to for n in told) == [AgentKey(P, 0), AgentKey(P, 1)]
    assert {(n.notice.state, n.notice.reason, n.notice.write_may_land) for n in told} == {
        (state, reason, False)
    }
    # A retried late report is told again (hosts act on one end per transfer).
    assert len(notices(rv.prefill_done("t", P, [[3]], 10)[1])) == 2
    # The decode side, kept and told when the transfer ended: a retry changes nothing.
    assert rv.register_decode("t", D, [[1]], 10)[1] == []


def test_a_named_engine_arriving_after_the_end_is_not_told_twice() -> None:
    rv, _ = core()
    rv.begin("t", P, D)
    _, effects = rv.cancel("t", "")
    assert {n.to for n in notices(effects)} == {AgentKey(P, 0), AgentKey(D, 0)}
    for late in (rv.prefill_done("t", P, [[3]], 10), rv.register_decode("t", D, [[1]], 10)):
        assert late[0].state is State.CANCELLED and late[1] == []


def test_cancel_after_order_fences_until_prefill_resolves() -> None:
    rv, _ = core()
    rv.register_decode("t", D, [[1]], 10)
    t, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    t, effects = rv.cancel("t", "abort")
    [c] = [e for e in effects if isinstance(e, SendCancelOrder)]
    assert c.to == AgentKey(P, 0) and c.order_id == o.order.order_id
    assert t.write_may_land
    assert notices(effects, AgentKey(D, 0))[0].notice.write_may_land is True
    effects = rv.write_report(AgentKey(P, 0), "i1", o.order.order_id, "t", WriteStatus.DROPPED)
    assert not may_land(t) and t.state is State.CANCELLED
    [n] = notices(effects, AgentKey(D, 0))
    assert n.notice.write_may_land is False and n.notice.state is State.CANCELLED


def test_write_failure_fails_fast_and_tells_decode() -> None:
    rv, _ = core()
    rv.register_decode("t", D, [[1]], 10)
    _, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    effects = rv.write_report(
        AgentKey(P, 0), "i1", o.order.order_id, "t", WriteStatus.FAILED, "peer disconnected"
    )
    t = rv.get("t")
    assert t.state is State.FAILED and t.reason is Reason.WRITE_FAILED
    assert "peer disconnected" in t.detail
    [n] = notices(effects, AgentKey(D, 0))
    assert n.notice.state is State.FAILED and n.notice.write_may_land is False


@pytest.mark.parametrize("first", ["decode", "prefill", "ordered"])
def test_every_waiting_state_expires(first: str) -> None:
    rv, clock = core(rendezvous_timeout_s=5, write_timeout_s=2, lease_s=100)
    if first in ("decode", "ordered"):
        rv.register_decode("t", D, [[1]], 10)
    if first in ("prefill", "ordered"):
        rv.prefill_done("t", P, [[3]], 10)
    clock.advance(1.9)
    assert rv.tick() == [] and not rv.get("t").state.terminal
    clock.advance(5)
    effects = rv.tick()
    t = rv.get("t")
    assert t.state is State.EXPIRED and t.reason is Reason.DEADLINE
    assert notices(effects)  # both sides are told, so blocks get reclaimed
    if first == "ordered":
        assert any(isinstance(e, SendCancelOrder) for e in effects)
        assert t.write_may_land


def test_two_prefill_ranks_need_every_rank() -> None:
    rv, _ = core(tp=2)
    rv.register_decode("t", D, [[1, 2]], 20)
    t, effects = rv.prefill_done("t", P, [[5, 6]], 20)
    os_ = orders(effects)
    assert sorted(o.order.prefill_rank for o in os_) == [0, 1]
    assert {o.order.targets[0].decode_rank for o in os_} == {0, 1}
    finish(rv, os_[0])
    assert t.state is State.WRITING and t.outstanding_ranks() == [1]
    finish(rv, os_[1])
    assert state_of(t) is State.COMPLETE and t.outstanding_ranks() == []


def test_new_incarnation_fences_the_old_one() -> None:
    rv, _ = core()
    rv.register_decode("t", D, [[1]], 10)
    _, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    effects = rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i2"))
    t = rv.get("t")
    assert t.state is State.FAILED and t.reason is Reason.AGENT_FENCED
    assert any(
        isinstance(e, SendPeerFenced) and e.to == AgentKey(D, 0) and e.peer_incarnation == "i1"
        for e in effects
    )
    # The fenced incarnation may still be alive until its lease ends.
    assert t.write_may_land
    with pytest.raises(PermissionDenied):
        rv.write_report(AgentKey(P, 0), "i2", o.order.order_id, "t", WriteStatus.DONE)
    # Orders are never reissued to the new incarnation.
    assert orders(effects) == []


def test_fenced_orders_resolve_when_old_lease_ends() -> None:
    rv, clock = core(lease_s=3, heartbeat_interval_s=1)
    rv.register_decode("t", D, [[1]], 10)
    rv.prefill_done("t", P, [[3]], 10)
    rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i2"))
    assert rv.get("t").write_may_land
    clock.advance(2)
    rv.agent_seen(AgentKey(D, 0), "i1")
    rv.agent_seen(AgentKey(P, 0), "i2")
    clock.advance(1.5)
    effects = rv.tick()
    t = rv.get("t")
    assert not t.write_may_land
    assert notices(effects, AgentKey(D, 0))[0].notice.write_may_land is False


def test_lost_agent_fails_its_transfers() -> None:
    rv, clock = core(lease_s=3, heartbeat_interval_s=1)
    rv.prefill_done("t", P, [[1]], 10)
    rv.register_decode("other", D, [[1]], 10)
    clock.advance(3.5)
    rv.agent_seen(AgentKey(D, 0), "i1")  # decode stays alive; prefill does not
    effects = rv.tick()
    t = rv.get("t")
    assert t.state is State.FAILED and t.reason is Reason.AGENT_LOST
    assert notices(effects, AgentKey(D, 0)) == []  # decode was never part of "t"
    assert rv.get("other").state is State.REGISTERED
    with pytest.raises(FailedPrecondition):
        rv.prefill_done("t2", P, [[1]], 10)


def test_a_starved_agent_whose_stream_stays_open_is_kept_until_silent_agent_s() -> None:
    """Past its lease, an agent whose stream is open (its process answers the
    transport's keepalive pings: starved, not dead) keeps its registration
    and its transfers wait; a heartbeat then carries on as if nothing had
    happened. Silent for silent_agent_s (a stuck process), it is lost. (Its
    orders' write timeout still bounds each transfer.)"""
    rv, clock = core(lease_s=3, heartbeat_interval_s=1, silent_agent_s=20, write_timeout_s=60)
    d = AgentKey(D, 0)
    rv.register_decode("t", D, [[1]], 10)
    _, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    for _ in range(4):  # 14 s without a word from the prefill rank
        clock.advance(3.5)
        rv.agent_seen(d, "i1")
        assert not notices(rv.tick())
    prefill = rv.registry.engine(P)
    assert rv.get("t").state is State.ORDERED and prefill is not None and prefill.ready
    wake = rv.next_wakeup()  # the tick comes back by the silent deadline
    assert wake is not None and wake <= clock.monotonic() + 6.0
    assert rv.agent_seen(AgentKey(P, 0), "i1")  # its process runs again: a heartbeat
    finish(rv, o)
    assert rv.get("t").state is State.COMPLETE

    rv.register_decode("t2", D, [[2]], 10)
    rv.prefill_done("t2", P, [[4]], 10)
    clock.advance(19.0)
    rv.agent_seen(d, "i1")
    rv.tick()
    assert rv.get("t2").state is State.ORDERED
    clock.advance(1.5)  # 20.5 s silent
    rv.agent_seen(d, "i1")
    rv.tick()
    t2 = rv.get("t2")
    assert t2.state is State.FAILED and t2.reason is Reason.AGENT_LOST


def test_a_starved_agent_whose_stream_closes_is_lost_at_its_lease() -> None:
    """The transport cut a connection whose ping went unanswered (a frozen or
    dead process): past its lease, the agent is lost at the next tick."""
    rv, clock = core(
        lease_s=3,
        heartbeat_interval_s=1,
        silent_agent_s=20,
        reconnect_grace_s=0,
        fail_on_disconnect=False,
    )
    rv.register_decode("t", D, [[1]], 10)
    rv.prefill_done("t", P, [[3]], 10)
    clock.advance(3.5)
    rv.agent_seen(AgentKey(D, 0), "i1")
    rv.tick()
    assert rv.get("t").state is State.ORDERED
    assert rv.agent_disconnected(AgentKey(P, 0), "i1") == []
    wake = rv.next_wakeup()
    assert wake is not None and wake <= clock.monotonic()
    rv.tick()
    t = rv.get("t")
    assert t.state is State.FAILED and t.reason is Reason.AGENT_LOST


def _delivered(rv: Rendezvous, tid: str, tp: int = 1) -> list[SendOrder]:
    """`tid` ordered on `tp` prefill ranks, each WRITE counted at decode, and
    no prefill rank's done report heard yet."""
    rv.register_decode(tid, D, [[1]], 10)
    _, effects = rv.prefill_done(tid, P, [[3]], 10)
    sent = orders(effects)
    assert len(sent) == tp
    for o in sent:
        rv.write_report(o.to, "i1", o.order.order_id, tid, WriteStatus.POSTED)
        for tgt in o.order.targets:
            key = AgentKey(tgt.decode_engine_id, tgt.decode_rank)
            rv.arrival_report(key, "i1", tid, [o.order.prefill_rank])
    assert rv.get(tid).state is State.WRITING and rv.get(tid).all_arrived()
    return sent


def test_a_prefill_agent_lost_after_decode_counted_its_writes_completes_them() -> None:
    """The done report is all that is missing (the notification of a WRITE
    comes only once its data landed): the transfer completes, not fails."""
    rv, clock = core(lease_s=3, heartbeat_interval_s=1)
    _delivered(rv, "t")
    rv.register_decode("waiting", D, [[2]], 10)  # decode's: prefill never came
    rv.register_decode("ordered", D, [[4]], 10)
    rv.prefill_done("ordered", P, [[5]], 10)  # ordered, nothing arrived
    clock.advance(3.5)
    rv.agent_seen(AgentKey(D, 0), "i1")
    effects = rv.tick()
    t = rv.get("t")
    assert t.state is State.COMPLETE and t.reason is Reason.NONE, t.detail
    assert t.orders[0].state is RankState.DONE and "landed" in t.orders[0].detail
    assert not t.write_may_land
    assert notices(effects, AgentKey(D, 0)) and all(
        n.notice.transfer_id != "t" for n in notices(effects, AgentKey(D, 0))
    )  # a clean COMPLETE: decode knew it; the failed "ordered" is told
    assert rv.get("ordered").state is State.FAILED
    assert rv.get("ordered").reason is Reason.AGENT_LOST
    assert rv.get("waiting").state is State.REGISTERED  # prefill was not part of it yet


def test_a_prefill_agent_gone_in_any_way_after_its_writes_landed_fails_nothing() -> None:
    rv, _ = core(reconnect_grace_s=0)
    [o] = _delivered(rv, "t")
    effects = rv.agent_disconnected(AgentKey(P, 0), "i1")
    assert rv.get("t").state is State.COMPLETE
    assert [e for e in effects if isinstance(e, AgentNotBack)] == [
        AgentNotBack(AgentKey(P, 0), "i1", 0)
    ]
    # Its report, when the same incarnation comes back, changes nothing.
    rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i1"))
    assert rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.DONE) == []
    _delivered(rv, "t2")
    rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i2"))  # a restart fences i1
    assert rv.get("t2").state is State.COMPLETE


def test_with_two_prefill_ranks_a_landed_transfer_waits_for_the_live_ranks_report() -> None:
    rv, clock = core(tp=2, lease_s=3, heartbeat_interval_s=1)
    sent = _delivered(rv, "t", tp=2)
    clock.advance(3.5)
    for r in range(2):
        rv.agent_seen(AgentKey(D, r), "i1")
    rv.agent_seen(AgentKey(P, 1), "i1")  # rank 0 alone is lost
    rv.tick()
    t = rv.get("t")
    assert state_of(t) is State.WRITING
    assert t.orders[0].state is RankState.DONE and t.orders[1].state is RankState.POSTED
    [o1] = [o for o in sent if o.order.prefill_rank == 1]
    rv.write_report(o1.to, "i1", o1.order.order_id, "t", WriteStatus.DONE)
    assert state_of(t) is State.COMPLETE


def test_disconnect_fails_moving_transfers_at_once_without_a_reconnect_grace() -> None:
    rv, _ = core(reconnect_grace_s=0)
    rv.register_decode("t", D, [[1]], 10)
    _, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.POSTED)
    effects = rv.agent_disconnected(AgentKey(P, 0), "i1")
    t = rv.get("t")
    assert t.state is State.FAILED and t.reason is Reason.AGENT_LOST
    assert t.detail == f"agent {AgentKey(P, 0)} disconnected"
    assert t.orders[0].state is RankState.POSTED and t.write_may_land
    assert [e for e in effects if isinstance(e, AgentNotBack)] == [
        AgentNotBack(AgentKey(P, 0), "i1", 1)
    ]
    # On reconnect with the same incarnation the agent is told to drop it.
    effects = rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i1"))
    assert [e.order_id for e in effects if isinstance(e, SendCancelOrder)] == [o.order.order_id]


def test_an_agent_back_within_its_reconnect_grace_loses_nothing() -> None:
    """A stream that blips: the same incarnation says hello again within
    the grace; its open order is sent again and the transfer completes."""
    rv, clock = core(reconnect_grace_s=1.0)
    rv.register_decode("t", D, [[1]], 10)
    _, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.POSTED)
    assert rv.agent_disconnected(AgentKey(P, 0), "i1") == []
    assert rv.get("t").state is State.WRITING
    prefill = rv.registry.engine(P)
    assert prefill is not None and prefill.ready  # within the grace
    assert not prefill.ranks[0].connected  # what the status shows for the rank
    # Meanwhile a new transfer is ordered, not failed "not ready": its order
    # waits for the agent's hello too.
    rv.register_decode("t2", D, [[2]], 10)
    t2, effects = rv.prefill_done("t2", P, [[4]], 10)
    [o2] = orders(effects)
    assert t2.state is State.ORDERED
    clock.advance(0.9)
    assert rv.tick() == []
    effects = rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i1"))
    sent_again = sorted(e.order.order_id for e in orders(effects))
    assert sent_again == sorted([o.order.order_id, o2.order.order_id])
    clock.advance(5.0)  # past the grace, and a lease renewed below
    rv.agent_seen(AgentKey(P, 0), "i1")
    rv.agent_seen(AgentKey(D, 0), "i1")
    assert not [e for e in rv.tick() if isinstance(e, AgentNotBack)]
    finish(rv, o)
    finish(rv, o2)
    assert rv.get("t").state is State.COMPLETE and rv.get("t2").state is State.COMPLETE


def test_an_agent_not_back_within_its_reconnect_grace_fails_its_engines_moving_transfers() -> None:
    rv, clock = core(reconnect_grace_s=1.0)
    rv.register_decode("t", D, [[1]], 10)
    rv.register_decode("waiting", D, [[2]], 10)  # not moving: it waits for prefill
    _, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    assert rv.agent_disconnected(AgentKey(P, 0), "i1") == []
    assert rv.next_wakeup() == pytest.approx(clock.monotonic() + 1.0)
    clock.advance(0.5)
    rv.begin("t2", P, D)
    rv.register_decode("t2", D, [[4]], 10)  # armed on the away agent meanwhile
    assert rv.get("t2").state is State.ARMED
    clock.advance(0.49)
    assert rv.tick() == [] and rv.get("t").state is State.ORDERED
    clock.advance(0.02)
    effects = rv.tick()
    t = rv.get("t")
    assert t.state is State.FAILED and t.reason is Reason.AGENT_LOST
    assert t.detail == f"agent {AgentKey(P, 0)} disconnected and not back within 1 s"
    assert rv.get("t2").state is State.FAILED
    assert [e for e in effects if isinstance(e, AgentNotBack)] == [
        AgentNotBack(AgentKey(P, 0), "i1", 2)
    ]
    told = sorted(n.notice.transfer_id for n in notices(effects, AgentKey(D, 0)))
    assert told == ["t", "t2"]
    # Not ready any more: a transfer whose sides meet now fails at once.
    prefill = rv.registry.engine(P)
    assert prefill is not None and not prefill.ready
    rv.register_decode("t3", D, [[5]], 10)
    t3, _ = rv.prefill_done("t3", P, [[6]], 10)
    assert t3.state is State.FAILED and "not ready" in t3.detail
    assert rv.get("waiting").state is State.REGISTERED
    # The same incarnation back later: told to drop both orders, nothing revived.
    effects = rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i1"))
    dropped = {e.transfer_id for e in effects if isinstance(e, SendCancelOrder)}
    assert dropped == {"t", "t2"} and o.order.transfer_id == "t"
    assert rv.get("t").state is State.FAILED


@pytest.mark.parametrize(
    ("link_lost", "fail_on_disconnect"),
    [(True, True), (False, False)],
    ids=["its-node-relay-lost", "without-fail-on-disconnect"],
)
def test_a_stream_that_does_not_fail_stays_ready_for_the_grace_then_waits_for_the_lease(
    link_lost: bool, fail_on_disconnect: bool
) -> None:
    """A rank cut off with its node relay (or any, without
    fail_on_disconnect): its transfers wait for its lease, and its engine
    stays ready for the reconnect grace, so a relay that blips fails no new
    transfer either; past the grace it is not ready, nothing failed."""
    rv, clock = core(reconnect_grace_s=1.0, lease_s=5.0, fail_on_disconnect=fail_on_disconnect)
    rv.register_decode("t", D, [[1]], 10)
    _, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    assert rv.agent_disconnected(AgentKey(P, 0), "i1", link_lost=link_lost) == []
    prefill = rv.registry.engine(P)
    assert prefill is not None and prefill.ready and not prefill.ranks[0].connected
    rv.register_decode("t2", D, [[2]], 10)
    t2, effects = rv.prefill_done("t2", P, [[4]], 10)
    [o2] = orders(effects)
    assert t2.state is State.ORDERED  # not failed "engine not ready"
    clock.advance(1.01)
    effects = rv.tick()
    assert [e for e in effects if isinstance(e, AgentNotBack)] == [
        AgentNotBack(AgentKey(P, 0), "i1", 0)
    ]
    assert not notices(effects)
    assert rv.get("t").state is State.ORDERED and rv.get("t2").state is State.ORDERED
    prefill = rv.registry.engine(P)
    assert prefill is not None and not prefill.ready
    rv.register_decode("t3", D, [[5]], 10)
    t3, _ = rv.prefill_done("t3", P, [[6]], 10)
    assert t3.state is State.FAILED and "not ready" in t3.detail
    # Back within the lease: both orders are sent again, the engine is ready.
    effects = rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i1"))
    sent_again = sorted(e.order.order_id for e in orders(effects))
    assert sent_again == sorted([o.order.order_id, o2.order.order_id])
    prefill = rv.registry.engine(P)
    assert prefill is not None and prefill.ready
    finish(rv, o)
    finish(rv, o2)
    assert rv.get("t").state is State.COMPLETE and rv.get("t2").state is State.COMPLETE


def test_a_new_incarnation_within_the_grace_fences_the_old_one_at_once() -> None:
    rv, clock = core(reconnect_grace_s=1.0)
    rv.register_decode("t", D, [[1]], 10)
    rv.prefill_done("t", P, [[3]], 10)
    assert rv.agent_disconnected(AgentKey(P, 0), "i1") == []
    rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i2"))  # the process restarted
    t = rv.get("t")
    assert t.state is State.FAILED and t.reason is Reason.AGENT_FENCED
    clock.advance(2.0)
    assert not [e for e in rv.tick() if isinstance(e, AgentNotBack)]


def test_the_reconnect_grace_may_be_zero_but_not_negative() -> None:
    assert CoreSettings(reconnect_grace_s=0).reconnect_grace_s == 0
    with pytest.raises(ValueError, match="reconnect_grace_s must be >= 0"):
        CoreSettings(reconnect_grace_s=-1)
    with pytest.raises(ValueError, match="lease_s must be > 0"):
        CoreSettings(lease_s=0)


def test_a_reconnecting_agent_is_told_again_of_what_ended_while_its_stream_was_lost() -> None:
    """Both ranks' streams lost at once (a node relay died): the notice to the
    decode rank was queued to its dying stream, and the release went out while
    it was away. Its hello to the same leader re-sends what it expects; the
    ended transfer is told again (released: the decode side may fail it), the
    live one is neither adopted nor told, and an unknown one is ignored."""
    rv, _ = core(reconnect_grace_s=0)
    rv.register_decode("t", D, [[1]], 10)
    rv.register_decode("live", D, [[2]], 10)
    _, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    effects = rv.agent_disconnected(AgentKey(P, 0), "i1")
    assert [n.notice.write_may_land for n in notices(effects, AgentKey(D, 0))] == [True]
    rv.agent_disconnected(AgentKey(D, 0), "i1")
    rv.agent_hello(reg(P, Role.PREFILL, 0, 1, inc="i1"))  # the cancel is replayed
    rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.DROPPED)
    assert not rv.get("t").write_may_land

    held = [HeldTransfer("t"), HeldTransfer("live"), HeldTransfer("unknown")]
    effects = rv.agent_hello(reg(D, Role.DECODE, 0, 1, inc="i1"), held)
    [told] = notices(effects, AgentKey(D, 0))
    assert told.notice.transfer_id == "t" and not told.notice.write_may_land
    assert told.notice.state is State.FAILED
    assert rv.get("live").state is State.REGISTERED and not rv.get("live").adopting
    assert not rv.has_transfer("unknown")
    # Without the held list (an agent that does not rebuild) nothing is told.
    assert notices(rv.agent_hello(reg(D, Role.DECODE, 0, 1, inc="i1"))) == []


def test_bad_input_names_the_field() -> None:
    rv, _ = core()
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: rv.register_decode("", D, [[1]], 1), "transfer_id"),
        (lambda: rv.register_decode("x" * 300, D, [[1]], 1), "transfer_id"),
        (lambda: rv.register_decode("a b", D, [[1]], 1), "transfer_id"),
        (lambda: rv.register_decode("t", D, [[-1]], 1), "block_ids[0]"),
        (lambda: rv.register_decode("t", D, [[1, 1]], 20), "block_ids[0]"),
        (lambda: rv.register_decode("t", D, [[64]], 1), "block_ids[0]"),
        (lambda: rv.register_decode("t", D, [[1], [2]], 1), "block_ids"),
        (lambda: rv.register_decode("t", D, [[1, 2, 3]], 16), "block_ids[0]"),
        (lambda: rv.register_decode("t", D, [[1]], 0), "num_tokens"),
        (lambda: rv.prefill_done("t", P, [[1]], 40), "block_ids[0]"),
    ]
    for call, field in cases:
        with pytest.raises(InvalidArgument) as exc:
            call()
        assert exc.value.field == field, (field, exc.value)
    with pytest.raises(FailedPrecondition) as fp:
        rv.register_decode("t", P, [[1]], 1)  # wrong role
    assert fp.value.field == "decode_engine_id"
    with pytest.raises(FailedPrecondition):
        rv.register_decode("t", EngineId("nobody"), [[1]], 1)
    with pytest.raises(NotFound):
        rv.get("missing")
    assert not rv.has_transfer("t")


def test_inflight_cap_and_retention() -> None:
    rv, clock = core(max_inflight=2, retention_s=10, lease_s=100)
    rv.register_decode("a", D, [[1]], 1)
    rv.register_decode("b", D, [[2]], 1)
    with pytest.raises(ResourceExhausted):
        rv.register_decode("c", D, [[3]], 1)
    rv.cancel("a", "")
    rv.register_decode("c", D, [[3]], 1)  # room again
    clock.advance(11)
    rv.tick()
    assert not rv.has_transfer("a")
    found, total = rv.find(TransferFilter(frozenset({State.REGISTERED})), 10)
    assert total == 2 and {t.transfer_id for t in found} == {"b", "c"}


def test_arrival_from_wrong_rank_is_rejected() -> None:
    rv, _ = core()
    rv.register_decode("t", D, [[1]], 10)
    rv.prefill_done("t", P, [[3]], 10)
    with pytest.raises(PermissionDenied):
        rv.arrival_report(AgentKey(P, 0), "i1", "t", [0])
    with pytest.raises(InvalidArgument):
        rv.arrival_report(AgentKey(D, 0), "i1", "t", [3])


def test_prefill_finished_is_recorded_at_the_engines_time_once() -> None:
    rv, _ = core()
    rv.register_decode("t", D, [[1]], 10)
    t, _ = rv.prefill_done("t", P, [[3]], 10, finished_unix=123.25)
    stages = [(s, at) for s, at, _ in t.timeline]
    i = stages.index(("prefill_finished", 123.25))
    assert stages[i + 1][0] == "prefill_done"  # recorded with it, before the order
    assert t.updated_wall != 123.25  # the coordinator's own clock stays the last update
    rv.prefill_done("t", P, [[3]], 10, finished_unix=999.0)  # an idempotent retry
    assert [s for s, _, _ in t.timeline].count("prefill_finished") == 1
    t2, _ = rv.prefill_done("u", P, [[3]], 10)  # 0: not sent (an older connector)
    assert "prefill_finished" not in [s for s, _, _ in t2.timeline]


def test_a_settled_transfer_drops_its_targets_and_keeps_its_status() -> None:
    """Once a transfer is terminal and no WRITE may land, its orders lose
    their targets (Transfer.compact: fewer objects per retained transfer for
    a full GC pass). Not before: a WRITE still in flight keeps its order
    whole. Status shows the same ranks after, and a late report still finds
    its order (a duplicate, ignored)."""
    from pushkv.controlplane.convert import transfer_to_pb
    from pushkv.controlplane.transfer import SETTLED_TARGETS

    def ranks(t: Transfer) -> list[tuple[int, str, int, bool, str]]:
        return [
            (r.prefill_rank, r.order_id, r.state, r.arrived, r.detail)
            for r in transfer_to_pb(t, deadline_wall=0.0).ranks
        ]

    rv, _ = core(tp=2)
    rv.register_decode("t", D, [[5, 6]], 20)
    t, effects = rv.prefill_done("t", P, [[1, 2]], 20)
    o0, o1 = orders(effects)
    finish(rv, o0)  # rank 0 written and counted
    rv.write_report(o1.to, "i1", o1.order.order_id, "t", WriteStatus.POSTED)
    rv.cancel("t", "test")
    assert state_of(t) is State.CANCELLED and may_land(t)  # rank 1's WRITE may land
    assert all(
        rec.order.targets and rec.order.targets is not SETTLED_TARGETS for rec in t.orders.values()
    )
    before = ranks(t)

    rv.write_report(o1.to, "i1", o1.order.order_id, "t", WriteStatus.FAILED, "cancelled")
    assert not may_land(t)
    assert all(rec.order.targets is SETTLED_TARGETS for rec in t.orders.values())
    after = ranks(t)
    assert [r[:2] + r[3:4] for r in after] == [r[:2] + r[3:4] for r in before]
    assert after[0][3] and not after[1][3]  # rank 0 arrived, rank 1 did not
    assert t.outstanding_ranks() == [1]
    assert rv.write_report(o1.to, "i1", o1.order.order_id, "t", WriteStatus.DONE) == []

    # A clean COMPLETE is compacted at once.
    rv.register_decode("u", D, [[7, 8]], 20)
    u, effects = rv.prefill_done("u", P, [[3, 4]], 20)
    for o in orders(effects):
        finish(rv, o)
    assert state_of(u) is State.COMPLETE
    assert all(rec.order.targets is SETTLED_TARGETS for rec in u.orders.values())
    assert [r[3] for r in ranks(u)] == [True, True]


def test_compaction_keeps_a_rank_with_nothing_to_write_apart() -> None:
    """A rank whose order never had a target (its heads written by another
    replica) counts as arrived; a compacted rank with targets still needs its
    arrival counted."""
    from pushkv.controlplane.domain import Order, OrderId, TransferId, WriteTarget
    from pushkv.controlplane.transfer import OrderRecord

    t = Transfer(TransferId("t"), State.FAILED, 0.0, 0.0, 60.0, 0.0)
    tgt = WriteTarget(D, 0, "i1", of((1,)), of((5,)), 1)
    for rank, targets in ((0, (tgt,)), (1, ())):
        o = Order(OrderId(f"o{rank}"), TransferId("t"), P, rank, "i1", targets, 0.0, 16)
        t.orders[rank] = OrderRecord(o, AgentKey(P, rank), RankState.FAILED)
    t.expected = {0: frozenset({0})}
    assert t.arrived_ranks() == {1}
    t.compact()
    assert t.orders[1].order.targets == () and t.orders[0].order.targets
    assert t.arrived_ranks() == {1} and t.outstanding_ranks() == [0, 1]


def test_the_clock_wakes_for_live_deadlines_only() -> None:
    """A transfer that ended leaves its deadline behind in the heap: the next
    wakeup is the live transfer's deadline or a lease, never the stale one
    (under load those come every few ms and woke the tick loop for nothing)."""
    rv, clock = core(lease_s=30.0, write_timeout_s=2.0)
    t0 = clock.monotonic()
    rv.register_decode("t", D, [[1]], 10)
    _, effects = rv.prefill_done("t", P, [[3]], 10)
    [o] = orders(effects)
    assert rv.next_wakeup() == pytest.approx(t0 + 2.0)  # t's write deadline
    finish(rv, o)
    assert rv.get("t").state is State.COMPLETE
    assert rv.next_wakeup() == pytest.approx(t0 + 30.0)  # the leases, not t's deadline
    clock.advance(1.0)
    rv.register_decode("t2", D, [[2]], 10)
    rv.prefill_done("t2", P, [[4]], 10)
    assert rv.next_wakeup() == pytest.approx(t0 + 3.0)
    clock.advance(2.01)
    rv.tick()
    assert rv.get("t2").state is State.EXPIRED
    assert rv.next_wakeup() == pytest.approx(t0 + 30.0)


def test_leases_expire_on_time_whatever_renewed_since_the_last_look() -> None:
    rv, clock = core(lease_s=5.0)
    t0 = clock.monotonic()
    clock.advance(4.0)
    rv.agent_seen(AgentKey(P, 0), "i1")  # P's lease now ends at 9, D's at 5
    wake = rv.next_wakeup()
    assert wake is not None and wake <= t0 + 5.0
    clock.advance(1.01)
    rv.tick()
    assert rv.registry.engine(D) is None and rv.registry.engine(P) is not None
    wake = rv.next_wakeup()
    assert wake is not None and t0 + 5.01 < wake <= t0 + 9.0
    rv.agent_seen(AgentKey(P, 0), "i1")  # at 5.01: now 10.01
    clock.advance(4.0)
    rv.tick()  # at 9.01, past the deadline the clock last knew of
    assert rv.registry.engine(P) is not None
    rv.agent_hello(reg(D, Role.DECODE, 0, 1, inc="i2"))  # at 9.01: ends at 14.01
    clock.advance(1.01)
    rv.tick()  # at 10.02
    assert rv.registry.engine(P) is None and rv.registry.engine(D) is not None
    assert rv.next_wakeup() == pytest.approx(t0 + 14.01)
    # A replaced incarnation's lease (its ghost) bounds the wakeup too.
    clock.advance(1.0)
    rv.agent_hello(reg(D, Role.DECODE, 0, 1, inc="i3"))  # fences i2, lease to 14.01
    assert rv.registry.may_still_act(AgentKey(D, 0), "i2", clock.monotonic())
    assert rv.next_wakeup() == pytest.approx(t0 + 14.01)
    clock.advance(3.0)
    rv.tick()
    assert not rv.registry.may_still_act(AgentKey(D, 0), "i2", clock.monotonic())
