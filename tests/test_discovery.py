"""What grpcurl does, done with server reflection only (pushkv/tools/reflection.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import cast

import grpc
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pushkv.tools import reflection as rc
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.sim_agent import SimCluster, ThreadedCoordinator, rendezvous, wait_terminal

PUSHKV = ("pushkv.v1.AgentService", "pushkv.v1.TransferService", "pushkv.v1.StatusService")


async def _complete_one(address: str, cluster: SimCluster, tid: str) -> None:
    await cluster.start()
    async with grpc.aio.insecure_channel(address) as ch:
        await rendezvous(ch, tid)
        t = (await wait_terminal(ch, [tid]))[tid]
    assert t.state == pb.TRANSFER_STATE_COMPLETE


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedCoordinator]:
    """A coordinator that completed transfer "disc-1"; agents stay connected."""
    with ThreadedCoordinator() as tc:
        cluster = SimCluster(tc.address, auto_complete=True)
        tc.run(_complete_one(tc.address, cluster, "disc-1"))
        yield tc
        tc.run(cluster.close())


@pytest.fixture
def channel(server: ThreadedCoordinator) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def test_list_services(server: ThreadedCoordinator) -> None:
    services = rc.list_services(server.address)
    for name in (*PUSHKV, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"):
        assert name in services
    assert services == sorted(services)


def test_describe_status_service(channel: grpc.Channel) -> None:
    text = rc.describe(channel, "pushkv.v1.StatusService")
    lines = text.splitlines()
    assert lines[0] == "pushkv.v1.StatusService is a service:"
    assert lines[1] == "service StatusService {" and lines[-1] == "}"
    rpcs = sorted(line.strip() for line in lines[2:-1])
    assert rpcs == [
        "rpc GetLeadership ( .pushkv.v1.GetLeadershipRequest ) returns ( .pushkv.v1.Leadership );",
        "rpc GetTransfer ( .pushkv.v1.GetTransferRequest ) returns ( .pushkv.v1.TransferStatus );",
        "rpc ListEngines ( .pushkv.v1.ListEnginesRequest ) returns "
        "( .pushkv.v1.ListEnginesResponse );",
        "rpc ListTransfers ( .pushkv.v1.ListTransfersRequest ) returns "
        "( .pushkv.v1.ListTransfersResponse );",
        "rpc WatchTransfers ( .pushkv.v1.WatchTransfersRequest ) returns "
        "( stream .pushkv.v1.TransferEvent );",
    ]


def test_describe_messages_methods_and_enums(channel: grpc.Channel) -> None:
    text = rc.describe(channel, "pushkv.v1.ListTransfersRequest")
    assert text.splitlines()[:3] == [
        "pushkv.v1.ListTransfersRequest is a message:",
        "message ListTransfersRequest {",
        "  repeated .pushkv.v1.TransferState states = 1;",
    ]
    assert "  uint32 limit = 5;" in text.splitlines()

    agent_msg = rc.describe(channel, ".pushkv.v1.AgentMessage")
    assert "  oneof kind {" in agent_msg.splitlines()
    assert "    .pushkv.v1.AgentHello hello = 1;" in agent_msg.splitlines()

    method = rc.describe(channel, "pushkv.v1.AgentService.AgentStream")
    assert method.splitlines() == [
        "pushkv.v1.AgentService.AgentStream is a method:",
        "rpc AgentStream ( stream .pushkv.v1.AgentMessage ) returns "
        "( stream .pushkv.v1.CoordinatorMessage );",
    ]

    enum = rc.describe(channel, "pushkv.v1.TransferState")
    assert "  TRANSFER_STATE_COMPLETE = 6;" in enum.splitlines()

    with pytest.raises(KeyError):
        rc.describe(channel, "pushkv.v1.NoSuchThing")


def test_reflected_classes_are_not_the_generated_ones(channel: grpc.Channel) -> None:
    r = rc.Reflector(channel)
    m = r.method("pushkv.v1.StatusService/ListTransfers")
    req_cls = r.message_class(m.input_type)
    assert req_cls is not pb.ListTransfersRequest
    assert m.input_type.file.pool is not descriptor_pool.Default()
    # Same wire format all the same.
    # A reflected class takes its fields as keywords, as the generated one does.
    make = cast(Callable[..., Message], req_cls)
    wire = make(limit=5, engine_id="d0").SerializeToString()
    assert pb.ListTransfersRequest.FromString(wire) == pb.ListTransfersRequest(
        limit=5, engine_id="d0"
    )


def test_call_list_transfers_from_json(server: ThreadedCoordinator) -> None:
    out = json.loads(
        rc.call_json(server.address, "pushkv.v1.StatusService/ListTransfers", '{"limit": 5}')
    )
    assert out["totalMatching"] == 1
    [t] = out["transfers"]
    assert t["transferId"] == "disc-1" and t["state"] == "TRANSFER_STATE_COMPLETE"
    assert t["decodeEngineId"] == "d0" and t["prefillEngineId"] == "p0"

    filtered = json.loads(
        rc.call_json(
            server.address,
            "pushkv.v1.StatusService/ListTransfers",
            '{"states": ["TRANSFER_STATE_FAILED"], "engine_id": "d0"}',
        )
    )
    assert filtered.get("transfers", []) == []


def test_call_get_transfer_from_json(channel: grpc.Channel) -> None:
    text = rc.call_json(
        channel,
        "pushkv.v1.StatusService/GetTransfer",
        '{"transfer_id": "disc-1"}',
        proto_names=True,
    )
    t = json.loads(text)
    assert t["transfer_id"] == "disc-1" and t["state"] == "TRANSFER_STATE_COMPLETE"
    assert t["decode_blocks"] == [{"ids": [7, 8, 9]}]
    assert t["ranks"][0]["state"] == "RANK_STATE_DONE" and t["ranks"][0]["arrived"] is True

    with pytest.raises(grpc.RpcError) as err:
        rc.call_json(channel, "pushkv.v1.StatusService/GetTransfer", '{"transfer_id": "nope"}')
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    with pytest.raises(KeyError):
        rc.call_json(channel, "pushkv.v1.StatusService/Nope", "{}")


def test_call_server_streaming_and_list_engines(channel: grpc.Channel) -> None:
    text = rc.call_json(
        channel,
        "pushkv.v1.StatusService/WatchTransfers",
        '{"include_existing": true}',
        max_messages=1,
    )
    event = json.loads(text)  # exactly one document: the replayed transfer
    assert event["transfer"]["transferId"] == "disc-1"

    engines = json.loads(rc.call_json(channel, "pushkv.v1.StatusService/ListEngines"))
    assert [e["engineId"] for e in engines["engines"]] == ["d0", "p0"]
    assert all(e["ready"] for e in engines["engines"])


def test_health_serving_via_reflection_and_stub(channel: grpc.Channel) -> None:
    for service in ("", "pushkv.v1.TransferService"):
        req = json.dumps({"service": service})
        out = json.loads(rc.call_json(channel, "grpc.health.v1.Health/Check", req))
        assert out == {"status": "SERVING"}
        r = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        rc.call_json(channel, "grpc.health.v1.Health/Check", '{"service": "no.such.Service"}')
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_bad_json_and_method_names_are_rejected(channel: grpc.Channel) -> None:
    from google.protobuf import json_format

    with pytest.raises(json_format.ParseError):
        rc.call_json(channel, "pushkv.v1.StatusService/ListTransfers", '{"limit": "many"}')
    with pytest.raises(ValueError):
        rc.call_json(channel, "ListTransfers", "{}")
    with pytest.raises(ValueError):
        rc.call_json(channel, "pushkv.v1.AgentService/AgentStream", "{}")


def test_reflection_works_against_a_running_asyncio_server() -> None:
    """Sanity: the module API opens and closes its own channel per call."""

    async def main() -> list[str]:
        from pushkv.controlplane.server import ServerSettings, start

        c = await start(ServerSettings(port=0))
        try:
            return await asyncio.to_thread(rc.list_services, c.address)
        finally:
            await c.stop(0)

    assert set(PUSHKV) <= set(asyncio.run(main()))
