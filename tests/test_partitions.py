"""The state machine split by transfer id (controlplane/partitions.py): the
same calls to one core and to K partitions answer the same, and what the
partitions add (routing, the registry copies, merged effects and reads,
each partition's share of the limits) does what it says. A fake clock, no
gRPC; the core tests (test_rendezvous.py and the modules importing
`each_core_shape`) also run on two partitions, and test_ha.py runs a
replica with `--partitions 2`."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushkv.controlplane.clock import FakeClock
from pushkv.controlplane.domain import (
    AgentKey,
    AgentNotBack,
    Effect,
    EngineId,
    HeldTransfer,
    OrderId,
    Role,
    SendCancelOrder,
    SendNotice,
    SendOrder,
    SendPeerFenced,
    State,
    TransferChanged,
    WriteStatus,
)
from pushkv.controlplane.errors import NotFound, ResourceExhausted
from pushkv.controlplane.partitions import (
    Core,
    Partitioned,
    make_core,
    partition_of,
    partition_settings,
)
from pushkv.controlplane.rendezvous import Rendezvous
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.transfer_filter import TransferFilter
from tests.support.core_shapes import ids_in_partition
from tests.test_rendezvous import D, P, finish, orders, reg

K = 3
TP = 2
AGENTS = [(P, Role.PREFILL, r) for r in range(TP)] + [(D, Role.DECODE, r) for r in range(TP)]


def ids_in_each_partition(per: int, k: int = K) -> list[str]:
    """`per` transfer ids in each of `k` partitions, partition by partition."""
    return [t for i in range(k) for t in ids_in_partition(i, per, k, "tx")]


IDS = ids_in_each_partition(2)


def partitioned(k: int = K, tp: int = 1, **kw: Any) -> tuple[Partitioned, FakeClock]:
    clock = FakeClock()
    core = make_core(CoreSettings(partitions=k, **kw), clock)
    assert isinstance(core, Partitioned)
    for r in range(tp):
        core.agent_hello(reg(P, Role.PREFILL, r, tp))
        core.agent_hello(reg(D, Role.DECODE, r, tp))
    return core, clock


# ---------------------------------------------------------------- routing


def test_a_transfer_id_lands_in_the_same_partition_in_every_process() -> None:
    # CRC-32 of the UTF-8 id: fixed, whatever the process's str hash seed.
    assert [partition_of(t, 4) for t in ("a", "tx-1", "cmpl-7f3e", "é")] == [3, 2, 3, 2]
    counts = collections.Counter(partition_of(f"cmpl-{n:08x}", 4) for n in range(20_000))
    assert sorted(counts) == [0, 1, 2, 3]
    assert max(counts.values()) < 1.05 * 5_000 and min(counts.values()) > 0.95 * 5_000


def test_one_partition_is_the_plain_core_and_the_count_is_bounded() -> None:
    assert isinstance(make_core(CoreSettings(), FakeClock()), Rendezvous)
    with pytest.raises(ValueError, match="partitions must be > 0"):
        CoreSettings(partitions=0)
    with pytest.raises(ValueError, match="at most 64"):
        CoreSettings(partitions=65)
    with pytest.raises(ValueError, match="at least 2"):
        Partitioned(CoreSettings(), FakeClock())


def test_transfers_in_every_partition_complete_with_distinct_order_ids() -> None:
    core, _ = partitioned(tp=2)
    ids: list[OrderId] = []
    for tid in IDS:
        core.register_decode(tid, D, [[5, 9]], 32)
        _, effects = core.prefill_done(tid, P, [[1, 2]], 32)
        sent = orders(effects)
        assert [o.to.rank for o in sent] == [0, 1]
        for o in sent:
            finish(core, o)
        assert core.get(tid).state is State.COMPLETE
        assert core.parts[partition_of(tid, K)].has_transfer(tid)
        ids += [o.order.order_id for o in sent]
    assert len(set(ids)) == len(ids) == 2 * len(IDS)
    # Each partition's ids carry its number: unique among the partitions.
    assert {i.rsplit("-", 1)[0] for i in ids} == {f"{core.coordinator_id}.{n}" for n in range(K)}
    assert core.inflight == 0 and core.transfers_begun == len(IDS)


# ---------------------------------------------------------------- agent events


def test_an_agent_lost_fails_its_transfers_in_every_partition_told_once() -> None:
    core, clock = partitioned(tp=2, lease_s=5, reconnect_grace_s=0)
    for tid in IDS:
        core.register_decode(tid, D, [[5, 9]], 32)
        core.prefill_done(tid, P, [[1, 2]], 32)
    assert core.inflight == len(IDS) == core.inflight_for(P)
    assert core.open_orders_of(AgentKey(P, 0), "i1") == len(IDS)
    effects = core.agent_disconnected(AgentKey(P, 1), "i1")
    # One line for the operator, with every partition's failures summed.
    [gone] = [e for e in effects if isinstance(e, AgentNotBack)]
    assert gone.transfers_failed == len(IDS)
    assert {e.transfer_id for e in effects if isinstance(e, TransferChanged)} == set(IDS)
    assert all(core.get(t).state is State.FAILED for t in IDS)
    # The lease lapses: every copy of the registry fences the agent, and each
    # peer is told once.
    for a in (AgentKey(P, 0), AgentKey(D, 0), AgentKey(D, 1)):
        assert core.agent_seen(a, "i1")
    clock.advance(6)
    for a in (AgentKey(P, 0), AgentKey(D, 0), AgentKey(D, 1)):
        assert core.agent_seen(a, "i1")
    fenced = [e for e in core.tick() if isinstance(e, SendPeerFenced)]
    assert sorted((e.to.engine_id, e.to.rank) for e in fenced) == [(D, 0), (D, 1), (P, 0)]
    assert all(not p.registry.is_current(AgentKey(P, 1), "i1") for p in core.parts)
    assert not core.agent_seen(AgentKey(P, 1), "i1")


def test_a_hello_s_held_transfers_are_adopted_each_in_its_partition() -> None:
    core, _ = partitioned(tp=1)
    core.lead()
    held = [HeldTransfer(t) for t in IDS]
    new = partitioned(tp=0)[0]
    new.lead()
    new.agent_hello(reg(P, Role.PREFILL, 0, 1), held, adopt=True)
    new.agent_hello(reg(D, Role.DECODE, 0, 1), held, adopt=True)
    for tid in IDS:
        part = new.parts[partition_of(tid, K)]
        assert part.has_transfer(tid) and new.get(tid).adopting
        assert sum(p.has_transfer(tid) for p in new.parts) == 1
    # The sides resubmitted: each transfer is ordered once, in its partition.
    for tid in IDS:
        new.register_decode(tid, D, [[5, 9]], 32, resubmitted=True)
        _, effects = new.prefill_done(tid, P, [[1, 2]], 32, resubmitted=True)
        [o] = orders(effects)
        finish(new, o)
        assert new.get(tid).state is State.COMPLETE


# ---------------------------------------------------------------- reads and limits


def test_a_listing_merges_the_partitions_newest_first() -> None:
    core, clock = partitioned()
    for tid in IDS:
        core.register_decode(tid, D, [[5]], 16)
        clock.advance(1)
    found, total = core.find(TransferFilter(), 4)
    assert total == len(IDS)
    assert [t.transfer_id for t in found] == IDS[::-1][:4]
    assert {t.transfer_id for t in core.transfers()} == set(IDS)
    assert [e.engine_id for e in core.engines()] == sorted([D, P])
    with pytest.raises(NotFound):
        core.get("nobody")


def test_each_partition_holds_its_share_of_the_limits() -> None:
    s = partition_settings(CoreSettings(max_inflight=10, max_inflight_per_engine=7), 3)
    assert (s.max_inflight, s.max_inflight_per_engine) == (4, 3)
    assert s.max_terminal == -(-CoreSettings().max_terminal // 3)
    core, _ = partitioned(max_inflight_per_engine=6)  # 2 per partition
    first = ids_in_partition(0, 3, K)
    core.register_decode(first[0], D, [[1]], 16)
    core.register_decode(first[1], D, [[1]], 16)
    with pytest.raises(ResourceExhausted, match="has 2 transfers in flight"):
        core.register_decode(first[2], D, [[1]], 16)
    # Another partition still has room: the engine holds 3 of its 6 so.
    other = next(t for t in IDS if partition_of(t, K) != 0)
    core.register_decode(other, D, [[1]], 16)
    assert core.inflight_for(D) == 3


# ---------------------------------------------------------------- the same answers


def _norm(effects: Iterable[Effect], ids: dict[str, str]) -> list[str]:
    """Effects as comparable strings, as a sorted multiset (partitions
    interleave transfers differently), order ids by transfer and rank."""
    out = []
    for e in effects:
        if isinstance(e, SendOrder):
            name = f"{e.order.transfer_id}/{e.order.prefill_rank}"
            ids[e.order.order_id] = name
            out.append(repr((e.to, e.incarnation, e.order._replace(order_id=OrderId(name)))))
        elif isinstance(e, SendCancelOrder):
            out.append(repr((e.to, e.incarnation, ids[e.order_id], e.transfer_id, e.reason)))
        elif isinstance(e, SendNotice | SendPeerFenced | AgentNotBack | TransferChanged):
            out.append(repr(e))
        else:  # pragma: no cover - a new effect type must be added here
            raise AssertionError(f"unknown effect {e!r}")
    return sorted(out)


class Twins:
    """One core and K partitions, given the same calls at the same clock."""

    def __init__(self, k: int) -> None:
        self.clock = FakeClock()
        kw: dict[str, Any] = dict(
            lease_s=5, reconnect_grace_s=1, rendezvous_timeout_s=10, write_timeout_s=6
        )
        self.cores: list[Core] = [
            make_core(CoreSettings(partitions=n, **kw), self.clock) for n in (1, k)
        ]
        self.ids: list[dict[str, str]] = [{}, {}]  # order id -> "transfer/rank", per core
        self.inc = {(e, r): "i1" for e, _, r in AGENTS}
        self.gen = 1
        for c in self.cores:
            c.lead()  # a failover's rules (adoption, resubmission) apply too
        for e, role, r in AGENTS:
            self.both("agent_hello", self._reg(e, role, r))

    def _reg(self, engine: EngineId, role: Role, rank: int) -> Any:
        return reg(engine, role, rank, TP, self.inc[(engine, rank)])

    def both(self, method: str, *args: Any, **kw: Any) -> None:
        """`method(*args, **kw)` on each core: the same error, or the same effects."""
        got: list[Any] = []
        for core, ids in zip(self.cores, self.ids, strict=True):
            try:
                res = getattr(core, method)(*args, **kw)
            except Exception as exc:
                got.append(("raised", type(exc).__name__))
                continue
            effects = res[1] if isinstance(res, tuple) else res
            got.append(_norm(effects, ids) if isinstance(effects, list) else effects)
        assert got[0] == got[1], method

    def order_of(self, i: int, tid: str, rank: int) -> str | None:
        name = f"{tid}/{rank}"
        return next((o for o, n in self.ids[i].items() if n == name), None)

    def report(self, tid: str, rank: int, status: WriteStatus, stale: bool) -> None:
        key = AgentKey(P, rank)
        found = [self.order_of(i, tid, rank) for i in (0, 1)]
        assert (found[0] is None) == (found[1] is None)
        if found[0] is None:
            return
        inc = "i0" if stale else self.inc[(P, rank)]
        for i in (0, 1):
            oid = found[i]
            assert oid is not None
            self.both_one(i, "write_report", key, inc, oid, tid, status)

    def both_one(self, i: int, method: str, *args: Any) -> None:
        """A call whose arguments differ per core (its own order id), on core
        `i`: the answers are compared once both ran."""
        try:
            res: Any = _norm(getattr(self.cores[i], method)(*args), self.ids[i])
        except Exception as exc:
            res = ("raised", type(exc).__name__)
        if i == 0:
            self._pending = res
        else:
            assert res == self._pending, method

    def check(self) -> None:
        """Everything readable agrees."""
        one, many = self.cores
        for tid in IDS:
            a, b = one.transfer(tid), many.transfer(tid)
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert (a.state, a.reason, a.detail, a.write_may_land) == (
                    b.state,
                    b.reason,
                    b.detail,
                    b.write_may_land,
                )
                assert a.outstanding_ranks() == b.outstanding_ranks()
        assert (one.inflight, one.transfers_begun) == (many.inflight, many.transfers_begun)
        assert one.next_wakeup() == many.next_wakeup()
        for e in (P, D):
            assert one.inflight_for(e) == many.inflight_for(e)
        for e, _, r in AGENTS:
            inc = self.inc[(e, r)]
            assert one.open_orders_of(AgentKey(e, r), inc) == many.open_orders_of(
                AgentKey(e, r), inc
            )
        assert [(x.engine_id, x.ready) for x in one.engines()] == [
            (x.engine_id, x.ready) for x in many.engines()
        ]
        a_found, a_total = one.find(TransferFilter(), 100)
        b_found, b_total = many.find(TransferFilter(), 100)
        assert a_total == b_total
        assert sorted(t.transfer_id for t in a_found) == sorted(t.transfer_id for t in b_found)


# The calls, weighted so that transfers get far: 0 begin, 1 decode side,
# 2 prefill side, 3 cancel, 4-5 a WRITE report (5: maybe from an old
# incarnation), 6 an arrival, 7 time passes, 8 a stream ends, 9 a hello,
# 10 a renewal, 11 a transfer's WRITEs and arrivals all reported.
OPS = [0, 1, 1, 1, 2, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 8, 9, 10, 11, 11]
STATUSES = [
    WriteStatus.POSTED,
    WriteStatus.DONE,
    WriteStatus.DONE,
    WriteStatus.FAILED,
    WriteStatus.DROPPED,
]


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data(), k=st.sampled_from([2, 3]))
def test_k_partitions_answer_every_call_as_one_core_does(data: st.DataObject, k: int) -> None:
    tw = Twins(k)
    tid = st.sampled_from(IDS)
    blocks = st.lists(st.integers(1, 60), min_size=2, max_size=2).map(lambda b: [b])
    for _ in range(data.draw(st.integers(5, 60))):
        op = data.draw(st.sampled_from(OPS))
        if op == 0:
            t = data.draw(tid)
            pe = data.draw(st.sampled_from([P, ""]))
            tw.both("begin", t, pe, D)
        elif op in (1, 2):
            t, b = data.draw(tid), data.draw(blocks)
            n = 16 * len(b[0])
            if op == 1:
                tw.both("register_decode", t, D, b, n)
            else:
                tw.both("prefill_done", t, P, b, n)
        elif op == 3:
            t = data.draw(tid)
            tw.both("cancel", t, "test")
        elif op in (4, 5):
            tw.report(
                data.draw(tid),
                data.draw(st.integers(0, TP - 1)),
                data.draw(st.sampled_from(STATUSES)),
                data.draw(st.booleans()) and op == 5,
            )
        elif op == 6:
            t, r = data.draw(tid), data.draw(st.integers(0, TP - 1))
            # Equal TP: decode rank r is written by prefill rank r (mostly told so).
            ranks = data.draw(
                st.just([r]) | st.lists(st.integers(0, TP - 1), min_size=1, max_size=TP)
            )
            inc = tw.inc[(D, r)]
            tw.both("arrival_report", AgentKey(D, r), inc, t, ranks)
        elif op == 7:
            tw.clock.advance(data.draw(st.sampled_from([0.2, 0.8, 1.5, 1.5, 4.0, 7.0])))
            if data.draw(st.sampled_from([True, True, True, False])):  # the heartbeats came
                for e, _, r in AGENTS:
                    inc = tw.inc[(e, r)]
                    tw.both("agent_seen", AgentKey(e, r), inc)
            tw.both("tick")
        elif op == 8:
            e, role, r = data.draw(st.sampled_from(AGENTS))
            inc = tw.inc[(e, r)]
            tw.both("agent_disconnected", AgentKey(e, r), inc)
        elif op == 9:
            e, role, r = data.draw(st.sampled_from(AGENTS))
            if data.draw(st.sampled_from([True, False, False])):  # a new one: the old is fenced
                tw.gen += 1
                tw.inc[(e, r)] = f"i{tw.gen}"
            x = tw._reg(e, role, r)
            # Sometimes as after a failover: re-sending some of its transfers.
            held = [HeldTransfer(t) for t in data.draw(st.lists(tid, max_size=3, unique=True))]
            adopt = data.draw(st.booleans())
            tw.both("agent_hello", x, held, adopt=adopt)
        elif op == 10:
            e, _, r = data.draw(st.sampled_from(AGENTS))
            inc = tw.inc[(e, r)]
            tw.both("agent_seen", AgentKey(e, r), inc)
        else:  # a transfer's agents do their part: every WRITE, then every arrival
            t = data.draw(tid)
            for r in range(TP):
                tw.report(t, r, WriteStatus.POSTED, False)
                tw.report(t, r, WriteStatus.DONE, False)
            for r in range(TP):
                inc = tw.inc[(D, r)]
                tw.both("arrival_report", AgentKey(D, r), inc, t, [r])
        tw.check()
