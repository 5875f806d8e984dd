"""A node relay (`pushkv relay`) killed with transfers in flight.

Real etcd, real coordinator replicas, a real relay process and real KV hosts
with their agents and NIXL, in the production shape: the agents rebuild on a
failover (the connector's default) and dial the relay, which dials the
replicas. Waits are polls or event waits under deadlines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import RelayProcess, leadership
from pushkv.rules import block_groups
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.client import Call, CoordinatorClient
from tests.support.etcd import EtcdServer, etcd  # noqa: F401  (the fixture)
from tests.support.kvpair import wait_state
from tests.test_ha import (
    CANARY,
    DEADLINE_S,
    NB,
    Cluster,
    _events,
    _register_and_done,
    _submit,
    _transfer,
    _wait_ready,
    poll,
    rebuilding_hosts,
    running_replicas,
)

pytestmark = pytest.mark.faults
# A lease the relay's restart fits in on a loaded box (the REPLICA flags give 2 s).
LONG_LEASE = ("--lease-s", "6")


def _ranks_connected(address: str) -> dict[str, bool]:
    with grpc.insecure_channel(address) as ch:
        engines = pbg.StatusServiceStub(ch).ListEngines(pb.ListEnginesRequest(), timeout=2)
    return {e.engine_id: all(r.connected for r in e.ranks) for e in engines.engines}


@dataclass(frozen=True)
class Case:
    how: str  # "kill": kill -9; "term": SIGTERM (a clean shutdown)
    back_within_lease: bool  # restarted at once, or only once the lease expired


CASES = {
    "kill-9-back-within-the-lease": Case("kill", True),
    "sigterm-back-within-the-lease": Case("term", True),
    "kill-9-back-after-the-lease": Case("kill", False),
}


@pytest.fixture(params=list(CASES))
def replicas(
    request: pytest.FixtureRequest,
    etcd: EtcdServer,  # noqa: F811
) -> Iterator[tuple[Cluster, Case]]:
    case = CASES[request.param]
    with running_replicas(etcd, *(LONG_LEASE if case.back_within_lease else ())) as c:
        yield c, case


def test_a_relay_lost_with_transfers_in_flight(replicas: tuple[Cluster, Case]) -> None:
    """The relay both agents dial is lost (kill -9 or SIGTERM) with one
    transfer moving (its WRITE held unposted) and one waiting for its
    prefill, then restarted on the same port. Its stream ended with the
    channels open: the agents are cut off, not gone, so the leader keeps their
    transfers for the agents' lease. Back within it, the agents' hellos take
    them back and the moving transfer completes (its order replayed, posted
    once). Back after it, the moving transfer has failed when the lease
    expired, and the hellos are told of it (never posted, the decode side
    told, the prefill blocks freed). Either way the waiting transfer and a
    new one complete with their bytes verified, and nothing is left held."""
    cluster, case = replicas
    keep = case.back_within_lease
    lead = cluster.leader()
    relay = RelayProcess(cluster.addresses).start()
    p, d = rebuilding_hosts(relay.address)
    client = CoordinatorClient(cluster.addresses, timeout_s=2.0)
    try:
        p.start()
        d.start()
        d.call("canary", CANARY)
        _wait_ready(lead.address)
        term = leadership(lead.address).term  # type: ignore[union-attr]
        _transfer(client, lead.address, p, d, "rk-before", seed=60)

        p.fill([1, 2], seed=61)
        p.fill([5, 6], seed=62)
        d.call("expect", ["rk-registered", "rk-ordered"])
        # Waiting for its prefill: the decode side registered only.
        _submit(client, Call("register", "r1", "rk-registered", "D", block_groups.of((22, 23)), 20))
        # Moving: ordered, its WRITE held unposted at the prefill agent.
        p.call("pause", True)
        _register_and_done(client, p, "rk-ordered", [26, 27], [5, 6])
        poll(
            lambda: any(h[0] == "rk-ordered" and h[2] for h in p.call("held")),
            "the order held unposted at the prefill agent",
        )
        written = p.call("writes_posted")

        killed = time.monotonic()
        if case.how == "kill":
            relay.kill()
        else:
            relay.stop()
        poll(lambda: not any(_ranks_connected(lead.address).values()), "both ranks disconnected")
        with grpc.insecure_channel(lead.address) as ch:
            st = pbg.StatusServiceStub(ch)
            # Disconnecting is what would fail it at once: that has run.
            moving = st.GetTransfer(pb.GetTransferRequest(transfer_id="rk-ordered"), timeout=5)
            assert moving.state == pb.TRANSFER_STATE_ORDERED, moving
            waiting = st.GetTransfer(pb.GetTransferRequest(transfer_id="rk-registered"), timeout=5)
            assert waiting.state == pb.TRANSFER_STATE_REGISTERED, waiting
            if not keep:  # the agents' lease expires first: both engines are lost
                for tid in ("rk-ordered", "rk-registered"):
                    failed = wait_state(st, tid, pb.TRANSFER_STATE_FAILED, DEADLINE_S)
                    assert failed.state == pb.TRANSFER_STATE_FAILED, failed
                    assert failed.reason == pb.REASON_AGENT_LOST, failed
                    assert "lease expired" in failed.detail, failed

        relay.start()  # on the same port: the agents have been redialing it
        _wait_ready(lead.address)
        followed = time.monotonic() - killed
        p.call("pause", False)
        if keep:  # the order, replayed to the same incarnation, is posted once
            assert d.wait_event("rk-ordered", DEADLINE_S).kind is EventKind.KV_READY
            assert d.check([26, 27], seed=62) == []
            assert p.wait_event("rk-ordered", DEADLINE_S).kind is EventKind.BLOCKS_FREE
        else:  # told again of the end, and the order cancelled: no WRITE
            assert d.wait_event("rk-ordered", DEADLINE_S).kind is EventKind.KV_FAILED
            freed = p.wait_event("rk-ordered", DEADLINE_S)
            assert freed.kind is EventKind.BLOCKS_FREE and "dropped" in freed.detail, freed
        assert p.call("writes_posted") == written + keep

        if keep:
            p.call("hold", ["rk-registered"])
            _submit(
                client,
                Call("prefill_done", "p1", "rk-registered", "P", block_groups.of((1, 2)), 20),
            )
            assert d.wait_event("rk-registered", DEADLINE_S).kind is EventKind.KV_READY
            assert d.check([22, 23], seed=61) == []
            assert p.wait_event("rk-registered", DEADLINE_S).kind is EventKind.BLOCKS_FREE
            with grpc.insecure_channel(lead.address) as ch:
                for tid in ("rk-registered", "rk-ordered"):
                    done = wait_state(
                        pbg.StatusServiceStub(ch), tid, pb.TRANSFER_STATE_COMPLETE, DEADLINE_S
                    )
                    assert done.state == pb.TRANSFER_STATE_COMPLETE, done
        else:  # told again: the decode side's registration was lost with it
            assert d.wait_event("rk-registered", DEADLINE_S).kind is EventKind.KV_FAILED
        completed = time.monotonic() - killed
        print(
            f"agents registered through the restarted relay {followed:.3f} s after its "
            f"{case.how}; the transfers in flight resolved {completed:.3f} s after it"
        )

        _transfer(client, lead.address, p, d, "rk-after", seed=63)
        # Kept: rk-ordered, rk-registered and rk-after; failed: rk-after only,
        # and blocks 22, 23, 26 and 27 keep the canary (never written).
        assert p.call("writes_posted") == written + (3 if keep else 1)
        used = [20, 21] + ([22, 23, 26, 27] if keep else [])
        assert d.call("check_canary", [b for b in range(NB) if b not in used], CANARY) == []
        assert p.call("held") == d.call("held") == []
        # The same leader and term throughout; each rank's channel opened on
        # the first relay stream and again on the restarted relay's.
        assert cluster.leader() is lead
        assert leadership(lead.address).term == term  # type: ignore[union-attr]
        opened = [(e["engine_id"], e["rank"]) for e in _events(lead, "node_channel_opened")]
        assert sorted(opened) == [("D", "0"), ("D", "0"), ("P", "0"), ("P", "0")]
        assert len(_events(lead, "node_stream_closed")) >= 1
    finally:
        client.close()
        p.stop()
        d.stop()
        relay.stop()
