"""Faults on a TP2 engine between stand-alone KV hosts: one of its ranks
killed (kill -9) mid-transfer.

Real agents in separate processes, real NIXL WRITEs, a real coordinator. The
decode blocks hold a canary before the transfer; each prefill rank's posting
is paused where the test needs its order to stay queued. Checked each time:
the transfer fails, naming the lost agent; every surviving prefill rank's
order is resolved (dropped, its blocks freed) and never posted, even once its
posting resumes; each surviving decode rank reports KV_FAILED only once the
coordinator says no WRITE can land (write_may_land false); the decode blocks
hold the canary everywhere but the slices written before the kill; nothing
stays held at the coordinator; and with the killed rank restarted the same
engines move a verified transfer, each surviving rank posting exactly its new
order (so the old one was dropped, not late)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.test_tp_kvhost import DST, HEAD_LEN, HEADS, NB, SRC, TOKENS, both_sides, wait_for

CANARY = 0x5A
DEADLINE_S = 20.0  # lease 2 s + write timeout 3 s, with room on a shared machine
AFTER_SRC, AFTER_DST = [20, 21], [10, 11]  # the healthy transfer after the fault


@pytest.fixture
def coord() -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess(
        "--lease-s",
        "2",
        "--heartbeat-interval-s",
        "0.5",
        "--write-timeout-s",
        "3",
        "--log-level",
        "WARNING",
    ).start()
    yield c
    c.stop()


def host(c: CoordinatorProcess, eid: str, role: str, rank: int, tp: int) -> KVHost:
    per = HEADS // tp
    spec = HostSpec(c.address, eid, role, rank, tp, NB, block_len=per * HEAD_LEN, kv_heads=per)
    return KVHost(spec).start()


class Cluster:
    def __init__(self, c: CoordinatorProcess, p_tp: int, d_tp: int) -> None:
        self.coord = c
        self.p_tp, self.d_tp = p_tp, d_tp
        self.p = [host(c, "P", "prefill", r, p_tp) for r in range(p_tp)]
        self.d = [host(c, "D", "decode", r, d_tp) for r in range(d_tp)]
        self.dead: list[KVHost] = []
        ch = grpc.insecure_channel(c.address)
        self.req = pbg.TransferServiceStub(ch)
        self.status = pbg.StatusServiceStub(ch)

    def kill(self, role: str, rank: int) -> None:
        hosts = self.p if role == "prefill" else self.d
        hosts[rank].kill()
        self.dead.append(hosts[rank])

    def restart(self, role: str, rank: int) -> KVHost:
        hosts, tp = (self.p, self.p_tp) if role == "prefill" else (self.d, self.d_tp)
        hosts[rank] = host(self.coord, hosts[rank].spec.engine_id, role, rank, tp)
        return hosts[rank]

    def nothing_held(self) -> None:
        for e in self.status.ListEngines(pb.ListEnginesRequest(), timeout=5).engines:
            assert e.inflight_transfers == 0, e
            assert all(r.inflight_orders == 0 for r in e.ranks), e

    def stop(self) -> None:
        for h in [*self.p, *self.d, *self.dead]:
            h.stop()


@pytest.fixture
def make(coord: CoordinatorProcess) -> Iterator[Callable[[int, int], Cluster]]:
    made: list[Cluster] = []

    def new(p_tp: int, d_tp: int) -> Cluster:
        made.append(Cluster(coord, p_tp, d_tp))
        return made[-1]

    yield new
    for m in made:
        m.stop()


def failed_agent_lost(c: Cluster, tid: str) -> pb.TransferStatus:
    t = wait_for(c.status, tid, lambda t: t.state == pb.TRANSFER_STATE_FAILED, DEADLINE_S)
    assert t.state == pb.TRANSFER_STATE_FAILED, t
    assert t.reason == pb.REASON_AGENT_LOST, t
    return t


def released(c: Cluster, decode: list[KVHost], tid: str) -> None:
    """Each decode rank fails the transfer, and only once no WRITE can land."""
    for h in decode:
        e = h.wait_event(tid, DEADLINE_S)
        assert e.kind is EventKind.KV_FAILED, e
        # The event came first; a status read after it must agree.
        t = c.status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)
        assert not t.write_may_land, t


def healthy_after(c: Cluster, tid: str, posted_before: list[int]) -> None:
    """A verified transfer on the same engines; each prefill rank posts its new
    order's WRITEs only, one per decode rank it writes (`posted_before`: its
    WRITEs so far)."""
    for h in c.d:
        h.call("expect", [tid])
    for h in c.p:
        h.fill(AFTER_SRC, seed=11)
    both_sides(c.req, tid, AFTER_SRC, AFTER_DST, 2 * 16)
    for h in c.d:
        assert h.wait_event(tid, DEADLINE_S).kind is EventKind.KV_READY
        assert h.call("check_heads", AFTER_DST, 11) == []
    t = wait_for(c.status, tid, lambda t: t.state == pb.TRANSFER_STATE_COMPLETE, DEADLINE_S)
    assert t.state == pb.TRANSFER_STATE_COMPLETE, t
    per_order = max(1, c.d_tp // c.p_tp)
    for h, before in zip(c.p, posted_before, strict=True):
        assert h.call("writes_posted") == before + per_order


@pytest.mark.parametrize("d_tp", [1, 2], ids=["tp2-into-tp1", "tp2-into-tp2"])
def test_a_prefill_rank_killed_mid_transfer(make: Callable[[int, int], Cluster], d_tp: int) -> None:
    """Prefill TP2: rank 0's slice lands, rank 1 is killed with its order queued."""
    c = make(2, d_tp)
    for h in c.d:
        h.call("canary", CANARY)
        h.call("expect", ["k"])
    for h in c.p:
        h.fill(SRC, seed=7)
    c.p[1].call("pause", True)
    both_sides(c.req, "k", SRC, DST, TOKENS)
    # Rank 0 wrote and its decode rank counted it; rank 1 is outstanding.
    t = wait_for(c.status, "k", lambda t: list(t.outstanding_ranks) == [1], DEADLINE_S)
    assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
        (0, pb.RANK_STATE_DONE, True),
        (1, pb.RANK_STATE_ORDERED, False),
    ]
    # With equal TP decode rank 0 has all it expects (its own KV is ready);
    # the transfer, and so the request, still waits for rank 1.
    waiting = c.d if d_tp == 1 else c.d[1:]
    if d_tp == 2:
        assert c.d[0].wait_event("k", DEADLINE_S).kind is EventKind.KV_READY
    c.kill("prefill", 1)

    t = failed_agent_lost(c, "k")
    assert t.ranks[0].state == pb.RANK_STATE_DONE, t
    assert t.ranks[1].state != pb.RANK_STATE_DONE, t
    released(c, waiting, "k")
    assert c.p[0].wait_event("k", DEADLINE_S).kind is EventKind.BLOCKS_FREE
    # The canary everywhere but rank 0's slices: its heads in DST, written before the kill.
    mine = HEADS // 2  # heads per prefill rank
    if d_tp == 1:
        rank1_heads = [(i, h) for i in range(len(DST)) for h in range(mine, HEADS)]
        assert c.d[0].call("check_heads", DST, 7) == rank1_heads
        assert c.d[0].call("check_canary", [b for b in range(NB) if b not in DST], CANARY) == []
    else:
        assert c.d[0].call("check_heads", DST, 7) == []  # rank 0 -> rank 0, whole blocks
        assert c.d[0].call("check_canary", [b for b in range(NB) if b not in DST], CANARY) == []
        assert c.d[1].call("check_canary", list(range(NB)), CANARY) == []
    c.nothing_held()

    c.restart("prefill", 1)
    healthy_after(c, "k-after", [1, 0])
    for h in c.d:  # the failed transfer's blocks: still as they were
        assert (
            h.call("check_canary", [b for b in range(NB) if b not in DST + AFTER_DST], CANARY) == []
        )
    c.nothing_held()


@pytest.mark.parametrize("p_tp", [1, 2], ids=["tp1-into-tp2", "tp2-into-tp2"])
def test_a_decode_rank_killed_mid_transfer(make: Callable[[int, int], Cluster], p_tp: int) -> None:
    """Decode TP2: rank 1 is killed while every prefill order is queued."""
    c = make(p_tp, 2)
    for h in c.d:
        h.call("canary", CANARY)
        h.call("expect", ["q"])
    for h in c.p:
        h.fill(SRC, seed=3)
        h.call("pause", True)
    t = both_sides(c.req, "q", SRC, DST, TOKENS)
    assert t.state == pb.TRANSFER_STATE_ORDERED, t
    c.kill("decode", 1)

    t = failed_agent_lost(c, "q")
    for h in c.p:
        assert h.wait_event("q", DEADLINE_S).kind is EventKind.BLOCKS_FREE
    released(c, c.d[:1], "q")
    t = c.status.GetTransfer(pb.GetTransferRequest(transfer_id="q"), timeout=5)
    assert all(r.state in (pb.RANK_STATE_DROPPED, pb.RANK_STATE_FAILED) for r in t.ranks), t
    for h in c.p:
        h.call("pause", False)  # the dropped order must not be posted now
    assert c.d[0].call("check_canary", list(range(NB)), CANARY) == []
    c.nothing_held()

    c.restart("decode", 1).call("canary", CANARY)
    healthy_after(c, "q-after", [0] * p_tp)
    for h in c.d:
        assert h.call("check_canary", [b for b in range(NB) if b not in AFTER_DST], CANARY) == []
    c.nothing_held()
