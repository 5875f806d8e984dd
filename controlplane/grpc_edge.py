"""The gRPC server's parts that the replica (server.py) and its front
processes (front_host.py) build alike: the options, the interceptor, the
services of a partitioned leader's front, health per service, reflection,
and the port."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pushkv.controlplane.auth import Authorizer
from pushkv.controlplane.front import PartitionFront
from pushkv.controlplane.front_servicers import (
    FrontAgentServicer,
    FrontStatusServicer,
    FrontTransferServicer,
)
from pushkv.controlplane.leadership import Leadership
from pushkv.controlplane.status_map import ErrorMappingInterceptor
from pushkv.net.tls import SERVER_PING_OPTIONS, TLSFiles
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

SERVICE_NAMES = tuple(
    pb.DESCRIPTOR.services_by_name[n].full_name
    for n in ("AgentService", "TransferService", "StatusService")
)
# Served by the leader only (controlplane/leadership.py); health says so per service.
WRITE_SERVICE_NAMES = SERVICE_NAMES[:2]


def new_server(max_message_bytes: int, authz: Authorizer, gate: Leadership) -> grpc.aio.Server:
    opts = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # gRPC's default on Linux, said here: a partitioned leader's front
        # processes listen on the replica's port (front_host.py).
        ("grpc.so_reuseport", 1),
        *SERVER_PING_OPTIONS,
    ]
    return grpc.aio.server(interceptors=[ErrorMappingInterceptor(authz, gate)], options=opts)


def add_front_services(
    server: grpc.aio.Server,
    front: PartitionFront,
    authz: Authorizer,
    gate: Leadership,
    index: int = 0,
) -> None:
    """The pushkv services of a partitioned leader's front `index`."""
    pbg.add_AgentServiceServicer_to_server(FrontAgentServicer(front, authz, gate), server)
    pbg.add_TransferServiceServicer_to_server(FrontTransferServicer(front, authz), server)
    pbg.add_StatusServiceServicer_to_server(FrontStatusServicer(front, gate, index), server)


def add_health_and_reflection(server: grpc.aio.Server) -> HealthServicer:
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return health_servicer


def bind(server: grpc.aio.Server, host: str, port: int, tls: TLSFiles) -> int:
    """Listen on host:port (0: a free port); the port bound."""
    address = f"{host}:{port}"
    if tls.enabled:
        bound = server.add_secure_port(address, tls.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


def health_status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


async def set_health(health_servicer: HealthServicer, gate: Leadership) -> None:
    """Health per service, as `gate` says: the write services only while
    this replica leads (or is the single coordinator)."""
    for name in ("", *SERVICE_NAMES):
        serving = gate.serving_writes or name not in WRITE_SERVICE_NAMES
        await health_servicer.set(name, health_status(serving))
