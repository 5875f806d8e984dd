"""Assembles the coordinator's gRPC server: services, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pushkv.controlplane import gcpolicy
from pushkv.controlplane.auth import Authorizer
from pushkv.controlplane.clock import Clock, SystemClock
from pushkv.controlplane.core_build import core_build
from pushkv.controlplane.leadership import (
    LOOP_STALL_LIMIT_S,
    ElectionSettings,
    Leadership,
    Role,
    View,
    election_key,
)
from pushkv.controlplane.logs import TransferLog
from pushkv.controlplane.metrics import CoordinatorMetrics, LeadershipCollector
from pushkv.controlplane.order_size import max_order_bytes
from pushkv.controlplane.runtime import Runtime
from pushkv.controlplane.servicers import AgentServicer, StatusServicer, TransferServicer
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.status_map import ErrorMappingInterceptor
from pushkv.controlplane.tracing import TransferTracer, tracer_from_env
from pushkv.net.event_loop import check_dump_after, event_loop_name, report_stalls
from pushkv.net.port_file import write_port_file
from pushkv.net.tls import TLSFiles, server_ping_options
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

log = structlog.get_logger("pushkv.coordinator")

# The exit status of a replica that lost the leadership: its supervisor restarts
# it, as a fresh standby (its in-memory state belongs to the old term).
EXIT_LEADERSHIP_LOST = 3
# etcd refused this replica's user, password or permissions (its log says which).
EXIT_ETCD_REFUSED = 4

SERVICE_NAMES = tuple(
    pb.DESCRIPTOR.services_by_name[n].full_name
    for n in ("AgentService", "TransferService", "StatusService")
)
# Served by the leader only (controlplane/leadership.py); health says so per service.
WRITE_SERVICE_NAMES = SERVICE_NAMES[:2]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 50151
    max_message_bytes: int = 4 * 1024 * 1024
    shutdown_grace_s: float = 5.0
    # When set, the bound port is written here once serving (useful with port 0).
    port_file: str = ""
    # Mutual TLS on every channel; without it the coordinator trusts every caller.
    tls: TLSFiles = field(default_factory=TLSFiles)
    core: CoreSettings = field(default_factory=CoreSettings)
    # Prometheus /metrics over HTTP on `host`: None = off, 0 = any free port.
    metrics_port: int | None = None
    # The per-rank pushkv_agent_* series beside the per-engine ones (--rank-metrics).
    rank_metrics: bool = True
    # Replicated coordinators (docs/reliability.md): etcd client URLs; empty =
    # the single in-memory coordinator, with no election.
    etcd: str = ""
    # The coordinator cell this replica belongs to (docs/operations.md,
    # "Coordinator cells"): its replicas campaign on /pushkv/cells/CELL/leader;
    # empty = /pushkv/coordinator/leader. Needs etcd.
    cell: str = ""
    # The address clients dial for this replica; empty = host:bound port.
    advertise: str = ""
    # TTL of the replica's etcd lease (s): failover takes about this long.
    etcd_lease_s: int = 2
    # TLS to etcd (https:// endpoints): its CA, and a client certificate and key
    # where etcd requires one.
    etcd_tls: TLSFiles = field(default_factory=TLSFiles)
    # etcd authentication: a user and the file holding its password.
    etcd_user: str = ""
    etcd_password_file: str = ""
    # A leader whose event loop has not run for this long lets its lease go.
    loop_stall_limit_s: float = LOOP_STALL_LIMIT_S
    # A loop that did not run for this long has every thread's stack written
    # to stderr (pushkv/net/event_loop.report_stalls); 0 = off.
    hang_dump_s: float = 0.0


@dataclass
class Coordinator:
    server: grpc.aio.Server
    runtime: Runtime
    health: HealthServicer
    port: int
    metrics: CoordinatorMetrics | None = None
    tracer: TransferTracer | None = None
    leadership: Leadership = field(default_factory=Leadership)
    election: Any = None  # controlplane.election.EtcdElection with --etcd
    election_task: asyncio.Task[None] | None = None
    # Set when this replica led and lost the leadership (the process should end).
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    pending: set[asyncio.Task[None]] = field(default_factory=set)  # health updates
    stall_task: asyncio.Task[None] | None = None  # logs a stalled event loop

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        return self.metrics.port if self.metrics is not None else None

    async def stop(self, grace: float | None = None) -> None:
        if self.stall_task is not None:
            self.stall_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.stall_task
        if self.election is not None:
            await self.election.resign()  # a standby leads at once
        if self.election_task is not None:
            self.election_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.election_task
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.runtime.stop()
        if self.metrics is not None:
            await self.metrics.close()
        if self.tracer is not None:
            self.tracer.close()


async def start(settings: ServerSettings, clock: Clock | None = None) -> Coordinator:
    """Start a coordinator; port 0 picks a free port (see Coordinator.port)."""
    if settings.etcd and not settings.advertise and settings.host in ("0.0.0.0", "::", "[::]"):
        raise ValueError(
            f"--host {settings.host} is no address a client can dial: give --advertise HOST:PORT"
        )
    if settings.cell and not settings.etcd:
        raise ValueError("--cell names an election on etcd: give --etcd too")
    election_key(settings.cell)  # a bad name is refused before anything starts
    check_dump_after(settings.hang_dump_s)
    limit = max_order_bytes(settings.max_message_bytes)
    runtime = Runtime(settings.core, clock or SystemClock(), limit)
    metrics = (
        CoordinatorMetrics(runtime, rank_series=settings.rank_metrics)
        if settings.metrics_port is not None
        else None
    )
    tracer = tracer_from_env(runtime)
    if metrics is not None:
        runtime.observers.append(metrics.events)
    if tracer is not None:
        runtime.observers.append(tracer)
    runtime.observers.append(TransferLog(runtime.core.has_transfer))
    authz = Authorizer(tls_enabled=settings.tls.enabled)
    # With --etcd a replica starts as a standby: nothing is written before it is elected.
    gate = Leadership(View(Role.STANDBY, etcd=settings.etcd) if settings.etcd else None)
    server = _new_server(settings.max_message_bytes, settings.core, authz, gate)
    transfers = TransferServicer(runtime, authz)
    agents = AgentServicer(runtime, authz, gate, submit=transfers.submit)
    pbg.add_AgentServiceServicer_to_server(agents, server)
    pbg.add_TransferServiceServicer_to_server(transfers, server)
    pbg.add_StatusServiceServicer_to_server(StatusServicer(runtime, gate), server)
    health_servicer = _add_health_and_reflection(server)
    if not settings.tls.enabled:
        log.warning("coordinator_insecure", detail="no TLS: every caller is trusted (dev mode)")
    port = _bind(server, settings.host, settings.port, settings.tls)
    if metrics is not None and settings.metrics_port is not None:
        metrics.serve(settings.host, settings.metrics_port)
    await server.start()
    runtime.start()
    await _set_health(health_servicer, gate)
    if metrics is not None:
        metrics.registry.register(LeadershipCollector(gate))
    coord = Coordinator(server, runtime, health_servicer, port, metrics, tracer, gate)
    coord.stall_task = asyncio.get_running_loop().create_task(
        report_stalls(_log_stall, dump_after_s=settings.hang_dump_s), name="stall-report"
    )
    if settings.etcd:
        _start_election(coord, settings)
    log.info(
        "coordinator_started",
        host=settings.host,
        port=port,
        coordinator_id=runtime.core.coordinator_id,
        core=core_build(),
        etcd=settings.etcd or None,
        cell=settings.cell or None,
        event_loop=event_loop_name(),
    )
    return coord


def _new_server(
    max_message_bytes: int, core: CoreSettings, authz: Authorizer, gate: Leadership
) -> grpc.aio.Server:
    # A frozen agent's connection is cut within its lease: a ping each
    # heartbeat interval, answered within the rest of the lease.
    interval = core.heartbeat_interval_s
    opts = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *server_ping_options(interval, max(core.lease_s - interval, interval)),
    ]
    return grpc.aio.server(interceptors=[ErrorMappingInterceptor(authz, gate)], options=opts)


def _add_health_and_reflection(server: grpc.aio.Server) -> HealthServicer:
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return health_servicer


def _bind(server: grpc.aio.Server, host: str, port: int, tls: TLSFiles) -> int:
    """Listen on host:port (0: a free port); the port bound."""
    address = f"{host}:{port}"
    if tls.enabled:
        bound = server.add_secure_port(address, tls.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


def _health_status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


async def _set_health(health_servicer: HealthServicer, gate: Leadership) -> None:
    """Health per service, as `gate` says: the write services only while
    this replica leads (or is the single coordinator)."""
    for name in ("", *SERVICE_NAMES):
        serving = gate.serving_writes or name not in WRITE_SERVICE_NAMES
        await health_servicer.set(name, _health_status(serving))


def _log_stall(seconds: float) -> None:
    log.warning(
        "coordinator_stalled",
        seconds=round(seconds, 1),
        detail="this process did not run its event loop for that long (its host paused, "
        "its cores oversubscribed, or a call blocked the loop): agents and clients heard "
        "nothing meanwhile",
    )


def _start_election(coord: Coordinator, settings: ServerSettings) -> None:
    """Campaign on etcd; the write services serve while this replica leads."""
    from pushkv.controlplane.election import EtcdElection  # aetcd only with --etcd

    election_settings = ElectionSettings(
        etcd=settings.etcd,
        advertise=settings.advertise or f"{settings.host}:{coord.port}",
        lease_s=settings.etcd_lease_s,
        key=election_key(settings.cell),
        tls_ca=settings.etcd_tls.ca,
        tls_cert=settings.etcd_tls.cert,
        tls_key=settings.etcd_tls.key,
        user=settings.etcd_user,
        password_file=settings.etcd_password_file,
        loop_stall_limit_s=settings.loop_stall_limit_s,
    )
    loop = asyncio.get_running_loop()

    def on_change(view: View) -> None:
        if view.role is Role.LEADER:
            # Stamped on every welcome, order and cancel from now on (term fencing).
            coord.runtime.lead(view.term)
        task = loop.create_task(_set_health(coord.health, coord.leadership))
        coord.pending.add(task)
        task.add_done_callback(coord.pending.discard)

    def on_lost(reason: str) -> None:
        coord.runtime.silence()  # no order leaves after this line
        coord.lost.set()

    coord.leadership.on_change.append(on_change)
    coord.election = EtcdElection(election_settings, coord.leadership, on_lost)
    coord.election_task = loop.create_task(coord.election.run(), name="etcd-election")


def tune_gc() -> None:
    """The GC policy of the process that runs the coordinator (see gcpolicy)."""
    gcpolicy.install()


async def serve(settings: ServerSettings) -> int:
    """Run until SIGTERM/SIGINT, then drain gracefully; the exit status.

    A replica that lost the leadership stops at once (EXIT_LEADERSHIP_LOST)."""
    tune_gc()
    # On etcd a pause past a quarter TTL would cost the leadership (gcpolicy.py).
    pause = settings.etcd_lease_s / 4 if settings.etcd else math.inf
    policy = gcpolicy.FullCollections(max_pause_s=pause)
    full_gc = asyncio.create_task(gcpolicy.full_collections(policy=policy))  # owned here
    try:
        coord = await start(settings)
        # A due full pass waits for a quiet second (gcpolicy.py).
        policy.activity = lambda: coord.runtime.core.transfers_begun
        if settings.port_file:
            write_port_file(settings.port_file, coord.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(coord.lost.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if coord.lost.is_set():
            refused = coord.election.refused if coord.election is not None else ""
            if refused:
                log.error("coordinator_stopping", reason=refused, exit=EXIT_ETCD_REFUSED)
                await coord.stop(0)
                return EXIT_ETCD_REFUSED
            log.error("coordinator_stopping", reason="leadership lost", exit=EXIT_LEADERSHIP_LOST)
            await coord.stop(0)
            return EXIT_LEADERSHIP_LOST
        log.info("coordinator_stopping", grace_s=settings.shutdown_grace_s)
        await coord.stop(settings.shutdown_grace_s)
        return 0
    finally:
        full_gc.cancel()
