"""Fault matrix on the data plane: real processes, real kill -9, real network cuts.

For every case: both sides resolve within a stated deadline, no WRITE lands in
blocks that were handed back (canary patterns), nothing stays held at the
coordinator, and a fresh transfer then succeeds. Lease: 2 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.kvpair import wait_state, wait_states
from tests.support.netcut import CuttableProxy

pytestmark = pytest.mark.faults

CANARY = 0x77
NB = 32
WRITE_TIMEOUT = ["--write-timeout-s", "3"]
LEASE = ["--lease-s", "2", "--heartbeat-interval-s", "0.5", "--log-level", "WARNING"]
LEASE += WRITE_TIMEOUT
# A lost coordinator: the agents resolve locally after this long (> write timeout + lease).
GIVE_UP_S = 6.0
DEADLINE_S = 20.0  # lease (2 s) + restart + reconnect backoff, with slack for a loaded 2-core box


@dataclass
class Rig:
    coord: CoordinatorProcess
    p: KVHost
    d: KVHost
    proxy: CuttableProxy | None = None
    extra: list[KVHost] = field(default_factory=list)

    @property
    def req(self) -> pbg.TransferServiceStub:
        return pbg.TransferServiceStub(grpc.insecure_channel(self.coord.address))

    @property
    def status(self) -> pbg.StatusServiceStub:
        return pbg.StatusServiceStub(grpc.insecure_channel(self.coord.address))

    def begin(self, tid: str) -> None:
        self.req.BeginTransfer(
            pb.BeginTransferRequest(transfer_id=tid, prefill_engine_id="P", decode_engine_id="D"),
            timeout=5,
        )

    def register(self, tid: str, blocks: list[int] = [1, 2]) -> pb.TransferStatus:  # noqa: B006
        return self.req.RegisterDecodeBlocks(
            pb.RegisterDecodeBlocksRequest(
                transfer_id=tid,
                decode_engine_id="D",
                block_ids=[pb.BlockIds(ids=blocks)],
                num_tokens=20,
            ),
            timeout=5,
        )

    def done(self, tid: str, blocks: list[int] = [5, 6]) -> pb.TransferStatus:  # noqa: B006
        self.p.call("hold", [tid])  # as the connector's worker half does
        return self.req.ReportPrefillDone(
            pb.ReportPrefillDoneRequest(
                transfer_id=tid,
                prefill_engine_id="P",
                block_ids=[pb.BlockIds(ids=blocks)],
                num_tokens=20,
            ),
            timeout=5,
        )

    def replace(self, which: str) -> KVHost:
        """Start a new incarnation of a killed host."""
        addr = self.proxy.address if (self.proxy and which == "P") else self.coord.address
        h = KVHost(HostSpec(addr, which, "prefill" if which == "P" else "decode", num_blocks=NB))
        h.start()
        self.extra.append(h)
        if which == "P":
            self.p = h
        else:
            self.d = h
        return h

    def healthy_transfer(self, tid: str) -> None:
        """The system serves a fresh transfer normally, bytes verified."""
        self.p.fill([9, 10], seed=42)
        self.d.call("expect", [tid])
        self.register(tid, [20, 21])
        self.done(tid, [9, 10])
        assert self.d.wait_event(tid, DEADLINE_S).kind is EventKind.KV_READY
        assert self.d.check([20, 21], seed=42) == []
        assert self.p.wait_event(tid, DEADLINE_S).kind is EventKind.BLOCKS_FREE
        t = wait_state(self.status, tid, pb.TRANSFER_STATE_COMPLETE, timeout=DEADLINE_S)
        assert t.state == pb.TRANSFER_STATE_COMPLETE

    def nothing_held(self) -> None:
        engines = self.status.ListEngines(pb.ListEnginesRequest(), timeout=5).engines
        for e in engines:
            assert e.inflight_transfers == 0, e
            assert all(r.inflight_orders == 0 for r in e.ranks), e


@pytest.fixture
def rig() -> Iterator[Rig]:
    coord = CoordinatorProcess(*LEASE).start()
    proxy = CuttableProxy("127.0.0.1", coord.port)
    # The prefill agent reaches the coordinator through a cuttable link.
    p = KVHost(HostSpec(proxy.address, "P", "prefill", num_blocks=NB, give_up_s=GIVE_UP_S))
    d = KVHost(HostSpec(coord.address, "D", "decode", num_blocks=NB, give_up_s=GIVE_UP_S))
    p.start()
    d.start()
    d.call("canary", CANARY)
    r = Rig(coord, p, d, proxy)
    try:
        yield r
    finally:
        for h in (r.p, r.d, p, d, *r.extra):
            h.stop()
        proxy.close()
        r.coord.stop()  # a test may have replaced the coordinator (crash and restart)
        coord.stop()


def _failed(rig: Rig, tid: str) -> pb.TransferStatus:
    t = wait_state(rig.status, tid, pb.TRANSFER_STATE_FAILED, timeout=DEADLINE_S)
    assert t.state == pb.TRANSFER_STATE_FAILED, t
    return t


def _losses_logged(rig: Rig, engine: str) -> list[dict[str, object]]:
    """The coordinator's agent_not_back lines for `engine`: its agent's
    stream closed and it did not come back within the reconnect grace."""
    return _coordinator_events(rig.coord, "agent_not_back", engine)


def _released(rig: Rig, tid: str) -> None:
    # decode blocks come back only when no WRITE can land any more: the agent
    # tells KV_FAILED on the coordinator's write_may_land=false notice.
    assert rig.d.wait_event(tid, DEADLINE_S).kind is EventKind.KV_FAILED
    t = rig.status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)
    assert not t.write_may_land, t
    assert rig.d.call("check_canary", list(range(NB)), CANARY) == []


# ---------------------------------------------------------------- prefill dies


def test_prefill_killed_before_decode_registered(rig: Rig) -> None:
    rig.begin("f1")
    rig.done("f1")
    rig.p.kill()
    t = _failed(rig, "f1")
    assert t.reason == pb.REASON_AGENT_LOST
    # The decode side arrives late and learns at once that there is nothing to wait for.
    assert rig.register("f1").state == pb.TRANSFER_STATE_FAILED
    rig.replace("P")
    rig.healthy_transfer("f1-after")
    rig.nothing_held()


def test_prefill_killed_after_registration_before_done(rig: Rig) -> None:
    rig.begin("f2")
    rig.d.call("expect", ["f2"])
    rig.register("f2")
    rig.p.kill()
    assert _failed(rig, "f2").reason == pb.REASON_AGENT_LOST
    # Logged before the status showed it (one loop callback): a loss that
    # failed a transfer is a warning that says how many.
    [loss] = _losses_logged(rig, "P")
    assert (loss["level"], loss["rank"], loss["transfers_failed"]) == ("warning", 0, 1)
    assert "not back within 1 s" in _failed(rig, "f2").detail
    _released(rig, "f2")
    rig.replace("P")
    rig.healthy_transfer("f2-after")
    rig.nothing_held()


def test_prefill_killed_during_write(rig: Rig) -> None:
    rig.p.call("pause", True)  # the order is queued at the prefill agent
    rig.d.call("expect", ["f3"])
    rig.register("f3")
    assert rig.done("f3").state == pb.TRANSFER_STATE_ORDERED
    rig.p.kill()
    assert _failed(rig, "f3").reason == pb.REASON_AGENT_LOST
    _released(rig, "f3")
    rig.replace("P")
    rig.healthy_transfer("f3-after")
    rig.nothing_held()


# ---------------------------------------------------------------- decode dies


def test_decode_killed_before_registration(rig: Rig) -> None:
    rig.begin("f4")
    rig.done("f4")
    rig.d.kill()
    assert _failed(rig, "f4").reason == pb.REASON_AGENT_LOST
    assert rig.p.wait_event("f4", DEADLINE_S).kind is EventKind.BLOCKS_FREE
    rig.replace("D").call("canary", CANARY)
    rig.healthy_transfer("f4-after")
    rig.nothing_held()


def test_decode_killed_after_registration(rig: Rig) -> None:
    rig.register("f5")
    rig.d.kill()
    assert _failed(rig, "f5").reason == pb.REASON_AGENT_LOST
    # The prefill side reports late and is told to free its blocks right away.
    assert rig.done("f5").state == pb.TRANSFER_STATE_FAILED
    rig.replace("D").call("canary", CANARY)
    rig.healthy_transfer("f5-after")
    rig.nothing_held()


def test_decode_killed_during_write(rig: Rig) -> None:
    rig.p.call("pause", True)
    rig.register("f6")
    rig.done("f6")
    rig.d.kill()
    rig.p.call("pause", False)
    assert _failed(rig, "f6").state == pb.TRANSFER_STATE_FAILED
    assert rig.p.wait_event("f6", DEADLINE_S).kind is EventKind.BLOCKS_FREE
    rig.replace("D").call("canary", CANARY)
    rig.healthy_transfer("f6-after")
    rig.nothing_held()


# ---------------------------------------------------------------- control plane


def test_coordinator_crash_mid_transfer(rig: Rig) -> None:
    rig.p.call("pause", True)
    rig.d.call("expect", ["f7"])
    rig.register("f7")
    rig.done("f7")
    port = rig.coord.port
    rig.coord.kill()
    rig.coord = CoordinatorProcess(*LEASE, port=port).start()
    # The new coordinator knows nothing of f7: the agents resolve it themselves.
    assert rig.p.wait_event("f7", DEADLINE_S).kind is EventKind.BLOCKS_FREE
    assert rig.d.wait_event("f7", DEADLINE_S).kind is EventKind.KV_FAILED
    rig.p.call("pause", False)
    assert rig.p.call("writes_posted") == 0
    assert rig.d.call("check_canary", list(range(NB)), CANARY) == []
    _wait_ready(rig)
    rig.healthy_transfer("f7-after")
    rig.nothing_held()


def test_coordinator_lost_for_good_resolves_locally(rig: Rig) -> None:
    """No coordinator comes back: once no WRITE can land (GIVE_UP_S, longer than
    the write timeout plus a lease), the prefill agent frees its blocks and the
    decode agent fails the transfer, so the engines recompute instead of
    waiting forever; nothing was written."""
    rig.p.call("pause", True)
    rig.d.call("expect", ["f8"])
    rig.register("f8")
    rig.done("f8")
    rig.coord.kill()
    assert rig.p.wait_event("f8", DEADLINE_S).kind is EventKind.BLOCKS_FREE
    assert rig.d.wait_event("f8", DEADLINE_S).kind is EventKind.KV_FAILED
    rig.p.call("pause", False)
    assert rig.p.call("writes_posted") == 0
    assert rig.d.call("check_canary", list(range(NB)), CANARY) == []


def test_coordinator_frozen_past_the_give_up_resolves_locally_then_serves(rig: Rig) -> None:
    """SIGSTOP: the coordinator stops answering with its connections open (a
    long pause, a frozen VM). The agents take its silence for a lease as a
    lost coordinator (agent/link.py, SilenceWatch), so the transfer in flight
    resolves locally after give_up_s, nothing written. Thawed, it takes the
    agents back and serves. Before the watchdog the agents waited on the open
    streams for as long as it was frozen."""
    rig.p.call("pause", True)
    rig.d.call("expect", ["f9"])
    rig.register("f9")
    rig.done("f9")
    rig.coord.freeze()
    try:
        assert rig.p.wait_event("f9", DEADLINE_S).kind is EventKind.BLOCKS_FREE
        assert rig.d.wait_event("f9", DEADLINE_S).kind is EventKind.KV_FAILED
    finally:
        rig.coord.thaw()
    rig.p.call("pause", False)
    _wait_ready(rig)
    assert rig.p.call("writes_posted") == 0
    assert rig.d.call("check_canary", list(range(NB)), CANARY) == []
    # Thawed, the coordinator ends f9 with whatever its loop takes first: the
    # write deadline that passed while it was frozen (EXPIRED) or, past the
    # reconnect grace, the agents' streams gone (FAILED, agent lost). Its order
    # stays open (a WRITE may land) until the prefill agent, back, reports it
    # dropped: the order sent again at the hello is answered from the agent's
    # record of finished orders. Nothing was written.
    over: set[int] = {pb.TRANSFER_STATE_FAILED, pb.TRANSFER_STATE_EXPIRED}
    t = wait_states(rig.status, "f9", over, timeout=DEADLINE_S)
    assert t.state in over, t
    t = _wait_settled(rig, "f9")
    assert t.state in over and not t.write_may_land, t
    rig.healthy_transfer("f9-after")
    rig.nothing_held()


def test_stream_cut_between_prefill_agent_and_coordinator(rig: Rig) -> None:
    assert rig.proxy is not None
    rig.p.call("pause", True)
    rig.d.call("expect", ["f8"])
    rig.register("f8")
    rig.done("f8")
    rig.proxy.cut()
    assert _failed(rig, "f8").reason == pb.REASON_AGENT_LOST
    # The cut-off agent's lease lapses before the decode side is released,
    # so the queued order is never posted even once resumed.
    _released(rig, "f8")
    rig.p.call("pause", False)
    rig.proxy.restore()
    _wait_ready(rig)
    assert rig.p.call("writes_posted") == 0
    rig.healthy_transfer("f8-after")
    rig.nothing_held()


def _wait_settled(rig: Rig, tid: str, timeout: float = DEADLINE_S) -> pb.TransferStatus:
    """`tid` once no WRITE of it may land (its orders all resolved)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        t = rig.status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=2)
        if not t.write_may_land or time.monotonic() >= deadline:
            return t
        time.sleep(0.05)  # polling the operator API under a deadline


def _wait_ready(rig: Rig, timeout: float = 15.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    ready: list[str] = []
    while time.monotonic() < deadline:
        try:
            engines = rig.status.ListEngines(pb.ListEnginesRequest(), timeout=2).engines
            # Connected: an engine is ready within a rank's reconnect grace
            # too, before the rank said hello again.
            ready = sorted(
                e.engine_id for e in engines if e.ready and all(r.connected for r in e.ranks)
            )
        except grpc.RpcError:
            ready = []
        if ready == ["D", "P"]:
            return
        time.sleep(0.05)  # polling the operator API under a deadline
    raise AssertionError(f"engines not ready after {timeout} s: {ready}")


# ---------------------------------------------------------------- a blip


def _coordinator_events(
    coord: CoordinatorProcess, event: str, engine: str
) -> list[dict[str, object]]:
    lines = [json.loads(ln) for ln in coord.log_text().splitlines() if ln.startswith("{")]
    return [ln for ln in lines if ln["event"] == event and ln.get("engine_id") == engine]


def test_a_stream_blip_within_the_reconnect_grace_loses_nothing() -> None:
    """The prefill agent's connection is reset (cut and restored at once) while
    it holds an order: it says hello again within the grace, the order is sent
    again, and the transfer completes with its bytes; nothing failed."""
    import time

    coord = CoordinatorProcess(
        *("--lease-s", "10", "--heartbeat-interval-s", "0.5", "--write-timeout-s", "15"),
        *("--reconnect-grace-s", "5", "--log-level", "INFO"),
    ).start()
    proxy = CuttableProxy("127.0.0.1", coord.port)
    p = KVHost(HostSpec(proxy.address, "P", "prefill", num_blocks=NB, give_up_s=GIVE_UP_S))
    d = KVHost(HostSpec(coord.address, "D", "decode", num_blocks=NB, give_up_s=GIVE_UP_S))
    rig = Rig(coord, p, d, proxy)
    try:
        p.start()
        d.start()
        p.fill([5, 6], seed=7)
        p.call("pause", True)  # the order waits at the prefill agent
        d.call("expect", ["b1"])
        rig.register("b1", [1, 2])
        assert rig.done("b1", [5, 6]).state == pb.TRANSFER_STATE_ORDERED
        proxy.cut()
        proxy.restore()
        deadline = time.monotonic() + DEADLINE_S
        while len(_coordinator_events(coord, "agent_registered", "P")) < 2:
            assert time.monotonic() < deadline, "the prefill agent did not come back"
            time.sleep(0.05)  # polling a log under a deadline
        assert len(_coordinator_events(coord, "agent_disconnected", "P")) == 1
        t = rig.status.GetTransfer(pb.GetTransferRequest(transfer_id="b1"), timeout=5)
        assert t.state == pb.TRANSFER_STATE_ORDERED, t  # not failed while it was away
        p.call("pause", False)
        assert d.wait_event("b1", DEADLINE_S).kind is EventKind.KV_READY
        assert d.check([1, 2], seed=7) == []
        assert p.call("writes_posted") == 1  # the order sent again was posted once
        t = wait_state(rig.status, "b1", pb.TRANSFER_STATE_COMPLETE, timeout=DEADLINE_S)
        assert t.state == pb.TRANSFER_STATE_COMPLETE, t
        assert _coordinator_events(coord, "agent_not_back", "P") == []
        rig.nothing_held()
    finally:
        for h in (p, d):
            h.stop()
        proxy.close()
        coord.stop()
