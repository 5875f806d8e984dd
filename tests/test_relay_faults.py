"""A node relay (`pushkv relay`) killed with transfers in flight.

Real etcd, real coordinator replicas, a real relay process and real KV hosts
with their agents and NIXL, in the production shape: the agents rebuild on a
failover (the connector's default) and dial the relay, which dials the
replicas. Waits are polls or event waits under deadlines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

from agent.events import EventKind
from harness.coordinator import RelayProcess, leadership
from harness.kvhost import HostSpec, KVHost
from tests.support.etcd import EtcdServer, etcd  # noqa: F401  (the fixture)
from tests.support.kvpair import wait_state
from tests.test_ha import (
    CANARY,
    DEADLINE_S,
    NB,
    REBUILD_GIVE_UP_S,
    Cluster,
    _events,
    _register_and_done,
    _submit,
    _transfer,
    _wait_ready,
    poll,
    running_replicas,
)
from vllm_integration.client import Call, CoordinatorClient

pytestmark = pytest.mark.faults
KEEP = ("--fail-on-disconnect", "false", "--lease-s", "6")


def _ranks_connected(address: str) -> dict[str, bool]:
    with grpc.insecure_channel(address) as ch:
        engines = pbg.StatusServiceStub(ch).ListEngines(pb.ListEnginesRequest(), timeout=2)
    return {e.engine_id: all(r.connected for r in e.ranks) for e in engines.engines}


@pytest.fixture(params=["fail-on-disconnect", "keep-within-lease"])
def replicas(
    request: pytest.FixtureRequest,
    etcd: EtcdServer,  # noqa: F811
) -> Iterator[tuple[Cluster, bool]]:
    """The default, or `--fail-on-disconnect false` with a lease (6 s) that
    the relay's restart fits in on a loaded box."""
    keep = request.param == "keep-within-lease"
    with running_replicas(etcd, *(KEEP if keep else ())) as c:
        yield c, keep


def test_a_relay_killed_with_transfers_in_flight(replicas: tuple[Cluster, bool]) -> None:
    """kill -9 of the relay both agents dial, one transfer moving (its WRITE
    held unposted) and one waiting for its prefill; the relay restarted on
    the same port. Its stream's end is each rank's stream lost: by default
    the leader fails the moving transfer at once (never posted, the decode
    side told, the prefill blocks freed); with `--fail-on-disconnect false`
    it keeps it for the lease and it completes once the agents are back
    through the restarted relay. Either way the waiting transfer and a new
    one complete with their bytes verified, and nothing is left held."""
    cluster, keep = replicas
    lead = cluster.leader()
    relay = RelayProcess(cluster.addresses).start()
    spec = {"num_blocks": NB, "give_up_s": REBUILD_GIVE_UP_S, "rebuild": True}
    p = KVHost(HostSpec(relay.address, "P", "prefill", **spec))  # type: ignore[arg-type]
    d = KVHost(HostSpec(relay.address, "D", "decode", **spec))  # type: ignore[arg-type]
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
        _submit(client, Call("register", "r1", "rk-registered", "D", (22, 23), 20))
        # Moving: ordered, its WRITE held unposted at the prefill agent.
        p.call("pause", True)
        _register_and_done(client, p, "rk-ordered", [26, 27], [5, 6])
        poll(
            lambda: any(h[0] == "rk-ordered" and h[2] for h in p.call("held")),
            "the order held unposted at the prefill agent",
        )
        written = p.call("writes_posted")

        killed = time.monotonic()
        relay.kill()
        poll(lambda: not any(_ranks_connected(lead.address).values()), "both ranks disconnected")
        if not keep:
            with grpc.insecure_channel(lead.address) as ch:
                st = pbg.StatusServiceStub(ch)
                failed = wait_state(st, "rk-ordered", pb.TRANSFER_STATE_FAILED, DEADLINE_S)
                waiting = st.GetTransfer(
                    pb.GetTransferRequest(transfer_id="rk-registered"), timeout=5
                )
            assert failed.state == pb.TRANSFER_STATE_FAILED, failed
            assert failed.reason == pb.REASON_AGENT_LOST and "disconnected" in failed.detail
            assert waiting.state == pb.TRANSFER_STATE_REGISTERED, waiting

        relay.start()  # on the same port: the agents have been redialing it
        _wait_ready(lead.address)
        followed = time.monotonic() - killed
        p.call("pause", False)
        if keep:  # the order, replayed to the same incarnation, is posted once
            assert d.wait_event("rk-ordered", DEADLINE_S).kind is EventKind.KV_READY
            assert d.check([26, 27], seed=62) == []
            assert p.wait_event("rk-ordered", DEADLINE_S).kind is EventKind.BLOCKS_FREE
        else:  # the replayed notice and cancel: one outcome each, no WRITE
            assert d.wait_event("rk-ordered", DEADLINE_S).kind is EventKind.KV_FAILED
            freed = p.wait_event("rk-ordered", DEADLINE_S)
            assert freed.kind is EventKind.BLOCKS_FREE and "dropped" in freed.detail, freed
        assert p.call("writes_posted") == written + keep

        p.call("hold", ["rk-registered"])
        _submit(client, Call("prefill_done", "p1", "rk-registered", "P", (1, 2), 20))
        assert d.wait_event("rk-registered", DEADLINE_S).kind is EventKind.KV_READY
        assert d.check([22, 23], seed=61) == []
        assert p.wait_event("rk-registered", DEADLINE_S).kind is EventKind.BLOCKS_FREE
        with grpc.insecure_channel(lead.address) as ch:
            for tid in ["rk-registered"] + (["rk-ordered"] if keep else []):
                done = wait_state(pbg.StatusServiceStub(ch), tid, pb.TRANSFER_STATE_COMPLETE, 10)
                assert done.state == pb.TRANSFER_STATE_COMPLETE, done
        completed = time.monotonic() - killed
        print(
            f"agents registered through the restarted relay {followed:.3f} s after its "
            f"kill -9; the kept transfers complete {completed:.3f} s after it"
        )

        _transfer(client, lead.address, p, d, "rk-after", seed=63)
        assert p.call("writes_posted") == written + keep + 2  # and rk-registered, rk-after
        # Failed, rk-ordered's 26 and 27 keep the canary: never written.
        used = [20, 21, 22, 23] + ([26, 27] if keep else [])
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
