"""Armed orders in the rendezvous core (pushkv.proto, TransferOrder.armed):
decode registers first, the announced prefill engine's agents get their orders
at once, and fire them themselves. Driven directly, with a fake clock."""

from __future__ import annotations

import pytest

from pushkv.controlplane.domain import (
    AgentKey,
    Effect,
    EngineId,
    Reason,
    Role,
    SendCancelOrder,
    SendOrder,
    State,
    WriteStatus,
)
from pushkv.controlplane.rendezvous import Rendezvous
from pushkv.controlplane.settings import CoreSettings
from tests.test_rendezvous import D, P, core, may_land, notices, orders, reg, state_of


def armed(rv: Rendezvous, tid: str = "t", dst: list[list[int]] | None = None) -> SendOrder:
    rv.begin(tid, P, D)
    t, effects = rv.register_decode(tid, D, dst or [[5, 9, 2]], 40)
    [o] = orders(effects)
    assert t.state is State.ARMED and o.order.armed
    return o


def report(rv: Rendezvous, o: SendOrder, status: WriteStatus) -> list[Effect]:
    return list(rv.write_report(o.to, "i1", o.order.order_id, o.order.transfer_id, status))


def arrive(rv: Rendezvous, o: SendOrder) -> list[Effect]:
    out: list[Effect] = []
    for tgt in o.order.targets:
        out += rv.arrival_report(
            AgentKey(tgt.decode_engine_id, tgt.decode_rank),
            "i1",
            o.order.transfer_id,
            [o.order.prefill_rank],
        )
    return out


def test_decode_first_arms_the_order_without_source_blocks() -> None:
    rv, _ = core()
    o = armed(rv)
    assert o.to == AgentKey(P, 0)
    [tgt] = o.order.targets
    assert tgt.src_blocks == ((),) and tgt.dst_blocks == ((5, 9, 2),)
    assert o.order.num_tokens == 40
    t = rv.get("t")
    assert t.write_may_land and t.outstanding_ranks() == [0]
    assert [s for s, _, _ in t.timeline] == ["begun", "decode_registered", "armed"]


def test_fired_write_completes_before_prefill_done_is_heard() -> None:
    """The agent posts and finishes on its own; prefill done comes last."""
    rv, _ = core()
    o = armed(rv)
    t = rv.get("t")
    report(rv, o, WriteStatus.POSTED)
    assert t.state is State.WRITING
    report(rv, o, WriteStatus.DONE)
    effects = arrive(rv, o)
    assert state_of(t) is State.COMPLETE and t.reason is Reason.NONE
    assert notices(effects) == []  # both sides know already
    t2, late = rv.prefill_done("t", P, [[1, 2, 3]], 40, finished_unix=1234.5)
    assert t2.state is State.COMPLETE and late == []  # no second order, no notice
    # When the prefill engine finished it is still recorded (the critical path's).
    assert ("prefill_finished", 1234.5, -1) in t2.timeline


def test_prefill_done_before_the_fire_is_heard_issues_nothing_new() -> None:
    rv, clock = core(write_timeout_s=3.0, lease_s=60.0)
    o = armed(rv)
    t, effects = rv.prefill_done("t", P, [[1, 2, 3]], 40)
    assert orders(effects) == [] and t.state is State.ORDERED
    # The write deadline runs from prefill done now, not the rendezvous one.
    clock.advance(3.5)
    rv.tick()
    assert state_of(t) is State.EXPIRED and may_land(t)
    report(rv, o, WriteStatus.DROPPED)
    assert not may_land(t)


@pytest.mark.parametrize("when", ["armed", "posted"])
def test_cancel_disarms_and_decode_waits_for_a_posted_write(when: str) -> None:
    rv, _ = core()
    o = armed(rv)
    t = rv.get("t")
    if when == "posted":
        report(rv, o, WriteStatus.POSTED)
    _, effects = rv.cancel("t", "client went away")
    [c] = [e for e in effects if isinstance(e, SendCancelOrder)]
    assert c.to == o.to and c.order_id == o.order.order_id
    assert t.state is State.CANCELLED and t.write_may_land
    [n] = notices(effects, AgentKey(D, 0))
    assert n.notice.write_may_land  # decode keeps its blocks until the outcome
    effects = report(rv, o, WriteStatus.DROPPED if when == "armed" else WriteStatus.DONE)
    [n] = notices(effects, AgentKey(D, 0))
    assert not n.notice.write_may_land


def test_armed_order_expires_with_the_rendezvous_deadline() -> None:
    rv, clock = core(rendezvous_timeout_s=10.0, lease_s=60.0)
    o = armed(rv)
    assert o.order.deadline_unix == pytest.approx(clock.wall() + 10.0)
    clock.advance(10.5)
    effects = rv.tick()
    t = rv.get("t")
    assert t.state is State.EXPIRED and "armed" in t.detail
    assert [e.order_id for e in effects if isinstance(e, SendCancelOrder)] == [o.order.order_id]


def test_prefill_done_that_disagrees_fails_the_transfer() -> None:
    rv, _ = core()
    armed(rv)
    t, effects = rv.prefill_done("t", P, [[1, 2, 3]], 41)
    assert t.state is State.FAILED and t.reason is Reason.MISMATCH
    assert "num_tokens" in t.detail
    assert [e for e in effects if isinstance(e, SendCancelOrder)]


def test_a_failed_fire_fails_the_transfer_at_once() -> None:
    rv, _ = core()
    o = armed(rv)
    report(rv, o, WriteStatus.FAILED)
    t = rv.get("t")
    assert t.state is State.FAILED and t.reason is Reason.WRITE_FAILED
    assert not t.write_may_land


def test_not_armed_without_an_announced_prefill_or_with_arming_off() -> None:
    rv, _ = core()
    t, effects = rv.register_decode("t", D, [[5, 9, 2]], 40)  # no BeginTransfer
    assert t.state is State.REGISTERED and orders(effects) == []
    rv2, _ = core(arm_orders=False)
    rv2.begin("t", P, D)
    t2, effects = rv2.register_decode("t", D, [[5, 9, 2]], 40)
    assert t2.state is State.REGISTERED and orders(effects) == []
    # Prefill first: an ordinary order, with its source blocks.
    rv3, _ = core()
    rv3.begin("t", P, D)
    rv3.prefill_done("t", P, [[1, 2, 3]], 40)
    t3, effects = rv3.register_decode("t", D, [[5, 9, 2]], 40)
    [o] = orders(effects)
    assert not o.order.armed and o.order.targets[0].src_blocks == ((1, 2, 3),)
    assert t3.state is State.ORDERED


def test_not_armed_when_the_prefill_engine_is_not_ready() -> None:
    clock_rv, _ = core()
    clock_rv.begin("t", EngineId("prefill-9"), D)
    clock_rv.agent_hello(reg("prefill-9", Role.PREFILL, 0, 2))  # 1 of 2 ranks
    t, effects = clock_rv.register_decode("t", D, [[5]], 10)
    assert t.state is State.REGISTERED and orders(effects) == []


def test_tp2_prefill_arms_one_order_per_rank_and_counts_every_writer() -> None:
    rv, _ = core(tp=2)
    rv.begin("t", P, D)
    t, effects = rv.register_decode("t", D, [[5, 9]], 20)
    os = orders(effects)
    assert sorted(o.to.rank for o in os) == [0, 1] and all(o.order.armed for o in os)
    for o in os:
        report(rv, o, WriteStatus.POSTED)
        report(rv, o, WriteStatus.DONE)
    assert t.state is State.WRITING and t.outstanding_ranks() == [0, 1]
    arrive(rv, os[0])
    assert t.outstanding_ranks() == [1]
    arrive(rv, os[1])
    assert state_of(t) is State.COMPLETE


def test_replayed_on_reconnect_still_armed() -> None:
    rv, _ = core()
    o = armed(rv)
    effects = rv.agent_hello(reg(P, Role.PREFILL, 0, 1))  # same incarnation reconnects
    [again] = orders(effects)
    assert again.order == o.order and again.order.armed


def test_settings_default_arms() -> None:
    assert CoreSettings().arm_orders is True
