"""Replicas whose state lives in partition processes behind two fronts
(`--partition-procs 2 --fronts 2`: the replica's own front and one front
process on its port, controlplane/front_host.py), on real etcd: every front
serves under its replica's election, and the kill -9 failover with agents
that rebuild completes as with one process (tests/test_ha.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pushkv.protocol import PROTOCOL_VERSION
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.etcd import EtcdServer, etcd  # noqa: F401  (the fixture)
from tests.test_ha import _events, _in_flight_transfers_complete, running_replicas

FRONTS = 2
# Fresh connections per check: a front never reached, at most 2 * 2^-40.
TRIES = 40
AGENTS = "pushkv.v1.AgentService"


def _per_front(address: str, check: Callable[[grpc.Channel], None]) -> dict[int, pb.Leadership]:
    """`check` on TRIES new connections to `address` (the kernel hands each
    to one front), with the view of the front that took each."""
    seen: dict[int, pb.Leadership] = {}
    for _ in range(TRIES):
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            view = pbg.StatusServiceStub(ch).GetLeadership(pb.GetLeadershipRequest(), timeout=5)
            check(ch)  # the same connection: the same front
            seen[view.front] = view
    assert set(seen) == set(range(FRONTS)), seen
    return seen


def _refuses_writes_naming(leader: str) -> Callable[[grpc.Channel], None]:
    def check(ch: grpc.Channel) -> None:
        begin = pb.BeginTransferRequest(
            transfer_id="ha-front", prefill_engine_id="P", decode_engine_id="D"
        )
        try:
            pbg.TransferServiceStub(ch).BeginTransfer(begin, timeout=5)
        except grpc.RpcError as e:
            exc = cast(grpc.Call, e)  # the sync API's RpcError is also its Call
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert ("pushkv-leader", leader) in tuple(exc.trailing_metadata() or ())
        else:
            raise AssertionError("a standby's front took a write")
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=AGENTS), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING

    return check


def _serves_writes(ch: grpc.Channel) -> None:
    """Health says so, and an agent's hello passes the front's fence (its
    order deadline, forwarded from the replica's lease renewals, is ahead):
    the partitions, not the fence, refuse this one for its protocol."""
    health = health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=AGENTS), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    answered = threading.Event()

    def hello_then_wait() -> Iterator[pb.AgentMessage]:
        yield pb.AgentMessage(hello=pb.AgentHello(protocol_version=PROTOCOL_VERSION + 100))
        answered.wait(5)  # the stream stays open until the answer (an end is the agent's)

    stream = pbg.AgentServiceStub(ch).AgentStream(hello_then_wait(), timeout=5)
    try:
        next(iter(stream))
    except grpc.RpcError as e:
        exc = cast(grpc.Call, e)
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        assert "agent speaks protocol" in (exc.details() or ""), exc
    else:
        raise AssertionError("a hello of another protocol was taken")
    finally:
        answered.set()


def test_fronts_follow_their_replica_and_in_flight_transfers_complete_through_a_new_leader(
    etcd: EtcdServer,  # noqa: F811
) -> None:
    """Every front of the standby refuses writes naming the leader, and says
    NOT_SERVING for the agent service; every front of the leader serves.
    Then the kill -9 failover with agents that rebuild: the new leader's
    partitions lead under its term, each adopts the transfers that hash to
    it, every in-flight transfer completes with its bytes verified and one
    WRITE each, and every front of the new leader answers as the leader of
    the new term."""
    with running_replicas(etcd, "--partition-procs", "2", "--fronts", str(FRONTS)) as cluster:
        for r in cluster.replicas:
            [started] = _events(r, "coordinator_started")
            assert started["partition_procs"] == "2" and started["fronts"] == str(FRONTS)
        lead = cluster.leader()
        (standby,) = cluster.standbys()
        led = _per_front(lead.address, _serves_writes)
        assert {v.role for v in led.values()} == {pb.LEADER_ROLE_LEADER}
        old_term = led[0].term
        stood = _per_front(standby.address, _refuses_writes_naming(lead.address))
        assert {(v.role, v.leader) for v in stood.values()} == {
            (pb.LEADER_ROLE_STANDBY, lead.address)
        }

        _in_flight_transfers_complete(cluster, "direct", "kill9")
        now = _per_front(standby.address, _serves_writes)
        assert {v.role for v in now.values()} == {pb.LEADER_ROLE_LEADER}
        assert {v.term for v in now.values()} == {now[0].term} and now[0].term > old_term
        # Each transfer lives in one partition only: the hellos' held
        # transfers were each adopted by the partition they hash to.
        with grpc.insecure_channel(standby.address) as ch:
            listed = pbg.StatusServiceStub(ch).ListTransfers(
                pb.ListTransfersRequest(limit=1000), timeout=5
            )
        ids = [t.transfer_id for t in listed.transfers]
        assert ids and len(ids) == len(set(ids)) == listed.total_matching, ids
