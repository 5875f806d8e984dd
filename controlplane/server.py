"""Assembles the coordinator's gRPC server: services, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1._async import HealthServicer

from pushkv.controlplane import gcpolicy, logs
from pushkv.controlplane.auth import Authorizer
from pushkv.controlplane.clock import Clock, SystemClock
from pushkv.controlplane.core_build import core_build
from pushkv.controlplane.front import PartitionFront
from pushkv.controlplane.front_link import FrontProcesses
from pushkv.controlplane.grpc_edge import (
    add_front_services,
    add_health_and_reflection,
    bind,
    new_server,
    set_health,
)
from pushkv.controlplane.leadership import (
    LOOP_STALL_LIMIT_S,
    ElectionSettings,
    Leadership,
    Role,
    View,
)
from pushkv.controlplane.logs import TransferLog
from pushkv.controlplane.metric_families import FamilyCopy
from pushkv.controlplane.metrics import CoordinatorMetrics, LeadershipCollector, Snapshot
from pushkv.controlplane.order_size import max_order_bytes
from pushkv.controlplane.partition_link import PartitionProcess
from pushkv.controlplane.runtime import Runtime
from pushkv.controlplane.servicers import AgentServicer, StatusServicer, TransferServicer
from pushkv.controlplane.settings import MAX_FRONTS, MAX_PARTITIONS, CoreSettings
from pushkv.controlplane.tracing import TransferTracer, tracer_from_env
from pushkv.net.event_loop import check_dump_after, event_loop_name, report_stalls
from pushkv.net.port_file import write_port_file
from pushkv.net.tls import TLSFiles
from pushkv.v1 import pushkv_pb2_grpc as pbg

log = structlog.get_logger("pushkv.coordinator")

# The exit status of a replica that lost the leadership: its supervisor restarts
# it, as a fresh standby (its in-memory state belongs to the old term).
EXIT_LEADERSHIP_LOST = 3
# etcd refused this replica's user, password or permissions (its log says which).
EXIT_ETCD_REFUSED = 4
# A partition process of this coordinator ended (--partition-procs), or a
# front process (--fronts): the state is gone.
EXIT_PARTITION_LOST = 5
# How long a lost partition waits for a front process's exit to name the cause.
FRONT_EXIT_S = 1.0


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
    # Experimental: the state machine in this many partition processes behind
    # a front in this one (controlplane/front.py; docs/reliability.md, "Past
    # one leader core"); 0 = in this process. Not with --partitions.
    partition_procs: int = 0
    # Experimental, with partition_procs: this many fronts on the port, the
    # replica's own and fronts - 1 front processes (controlplane/front_host.py).
    fronts: int = 1
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
    front: PartitionFront | None = None  # --partition-procs: the partitions' front
    partitions: list[PartitionProcess] = field(default_factory=list)
    socket_dir: str = ""  # the partitions' sockets (removed at stop)
    fronts: FrontProcesses | None = None  # --fronts F: the front processes

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
        stopping = [self.server.stop(grace)]
        if self.fronts is not None:  # each front lets its own calls finish meanwhile
            stopping.append(self.fronts.close(grace))
        await asyncio.gather(*stopping)
        await self.runtime.stop()
        await _stop_partitions(self.front, self.partitions, self.socket_dir)
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
    check_partition_procs(settings)
    check_dump_after(settings.hang_dump_s)
    limit = max_order_bytes(settings.max_message_bytes)
    runtime = Runtime(settings.core, clock or SystemClock(), limit)
    metrics = (
        CoordinatorMetrics(runtime, rank_series=settings.rank_metrics)
        if settings.metrics_port is not None
        else None
    )
    # With partition processes each traces its own transfers (partition_host.py).
    tracer = None if settings.partition_procs else tracer_from_env(runtime)
    if metrics is not None:
        runtime.observers.append(metrics.events)
    if tracer is not None:
        runtime.observers.append(tracer)
    runtime.observers.append(TransferLog(runtime.core.has_transfer))
    authz = Authorizer(tls_enabled=settings.tls.enabled)
    # With --etcd a replica starts as a standby: nothing is written before it is elected.
    gate = Leadership(View(Role.STANDBY, etcd=settings.etcd) if settings.etcd else None)
    server = new_server(settings.max_message_bytes, authz, gate)
    front, partitions, socket_dir = await _start_partitions(settings, runtime)
    if front is not None and metrics is not None:
        metrics.gather = front.metrics_snapshot  # the partitions' state, merged
    try:
        if front is None:
            transfers = TransferServicer(runtime, authz)
            agents = AgentServicer(runtime, authz, gate, submit=transfers.submit)
            pbg.add_AgentServiceServicer_to_server(agents, server)
            pbg.add_TransferServiceServicer_to_server(transfers, server)
            pbg.add_StatusServiceServicer_to_server(StatusServicer(runtime, gate), server)
        else:
            add_front_services(server, front, authz, gate)
        health_servicer = add_health_and_reflection(server)
        if not settings.tls.enabled:
            log.warning("coordinator_insecure", detail="no TLS: every caller is trusted (dev mode)")
        port = bind(server, settings.host, settings.port, settings.tls)
        if metrics is not None and settings.metrics_port is not None:
            metrics.serve(settings.host, settings.metrics_port)
        await server.start()
        fronts = await _start_fronts(settings, gate, socket_dir, port)
        if front is not None and fronts is not None and metrics is not None:
            metrics.gather = _gather_with_fronts(front, fronts, metrics)
    except BaseException:  # the partitions started are this call's to stop
        await server.stop(0)
        await _stop_partitions(front, partitions, socket_dir)
        raise
    runtime.start()
    await set_health(health_servicer, gate)
    if metrics is not None:
        metrics.registry.register(LeadershipCollector(gate))
    coord = Coordinator(server, runtime, health_servicer, port, metrics, tracer, gate)
    coord.front, coord.partitions, coord.socket_dir = front, partitions, socket_dir
    coord.fronts = fronts
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
        partitions=settings.core.partitions,
        partition_procs=settings.partition_procs,
        fronts=settings.fronts,
        etcd=settings.etcd or None,
        event_loop=event_loop_name(),
    )
    return coord


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
            if coord.front is not None:
                coord.front.lead(view.term)
        # The front processes follow the view through the gate (front_link.py).
        task = loop.create_task(set_health(coord.health, coord.leadership))
        coord.pending.add(task)
        task.add_done_callback(coord.pending.discard)

    def on_lost(reason: str) -> None:
        coord.runtime.silence()  # no order leaves after this line
        if coord.front is not None:
            coord.front.silence()
        if coord.fronts is not None:
            coord.fronts.silence()
        coord.lost.set()

    coord.leadership.on_change.append(on_change)
    coord.election = EtcdElection(election_settings, coord.leadership, on_lost)
    coord.election_task = loop.create_task(coord.election.run(), name="etcd-election")


def check_partition_procs(settings: ServerSettings) -> None:
    """--partition-procs K: what this experimental mode does not take yet."""
    k = settings.partition_procs
    if not k:
        if settings.fronts != 1:
            raise ValueError(
                "--fronts (experimental) needs --partition-procs: the fronts share "
                "the partition processes' state"
            )
        return
    if not 1 <= k <= MAX_PARTITIONS:
        raise ValueError(f"--partition-procs must be 1 to {MAX_PARTITIONS}, got {k}")
    if not 1 <= settings.fronts <= MAX_FRONTS:
        raise ValueError(f"--fronts must be 1 to {MAX_FRONTS}, got {settings.fronts}")
    if settings.core.partitions > 1:
        raise ValueError(
            "--partitions and --partition-procs are one split of the state machine, "
            "in this process or in that many processes: give one of them"
        )


async def _start_partitions(
    settings: ServerSettings, runtime: Runtime
) -> tuple[PartitionFront | None, list[PartitionProcess], str]:
    """--partition-procs K: the partition processes, started under this
    coordinator's id, and their front; (None, [], "") without it."""
    k = settings.partition_procs
    if not k:
        return None, [], ""
    socket_dir = tempfile.mkdtemp(prefix="pushkv-partitions-")  # mode 0700: this user's
    parts: list[PartitionProcess] = []
    try:
        for i in range(k):
            parts.append(
                await PartitionProcess.start(
                    socket_dir,
                    i,
                    k,
                    term=0,
                    coordinator_id=runtime.core.coordinator_id,
                    settings=settings.core,
                    metrics=settings.metrics_port is not None,
                    rank_metrics=settings.rank_metrics,
                    fronts=settings.fronts,
                    log_level=logs.level_name(),  # as the replica's
                )
            )
    except BaseException:
        for p in parts:
            await p.close()
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise
    front = PartitionFront(parts)
    front.start()
    return front, parts, socket_dir


async def _start_fronts(
    settings: ServerSettings, gate: Leadership, socket_dir: str, port: int
) -> FrontProcesses | None:
    """--fronts F: F - 1 front processes on this replica's bound port."""
    if settings.fronts <= 1:
        return None
    return await FrontProcesses.start(
        settings.fronts - 1,
        socket_dir=socket_dir,
        k=settings.partition_procs,
        address=f"{settings.host}:{port}",
        gate=gate,
        tls=settings.tls,
        max_message_bytes=settings.max_message_bytes,
        log_level=logs.level_name(),
        hang_dump_s=settings.hang_dump_s,
    )


def _gather_with_fronts(
    front: PartitionFront, fronts: FrontProcesses, metrics: CoordinatorMetrics
) -> Callable[[list[FamilyCopy]], Awaitable[Snapshot]]:
    """A scrape with front processes: the partitions' state, merged, with
    the event loop lag of every front process next to this one's."""

    async def gather(own: list[FamilyCopy]) -> Snapshot:
        lag = await fronts.loop_lag()
        return await front.metrics_snapshot(metrics.with_loop_lag(own, lag))

    return gather


async def _stop_partitions(
    front: PartitionFront | None, parts: list[PartitionProcess], socket_dir: str
) -> None:
    if front is not None:
        await front.stop()
    for p in parts:
        await p.close()
    if socket_dir:
        shutil.rmtree(socket_dir, ignore_errors=True)


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
        if coord.front is not None:
            waits.append(asyncio.ensure_future(coord.front.dead.wait()))
        if coord.fronts is not None:
            waits.append(asyncio.ensure_future(coord.fronts.dead.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if coord.front is not None and coord.front.dead.is_set() and coord.fronts is not None:
            # A front process that died ends the partitions' connections too:
            # its exit, seen a moment later, names the cause.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(coord.fronts.dead.wait(), FRONT_EXIT_S)
        broken = [  # a front process's end first: its partitions end with it
            *(coord.fronts.broken if coord.fronts is not None else []),
            *(coord.front.broken if coord.front is not None else []),
        ]
        if broken:
            log.error("coordinator_stopping", reason=broken[0], exit=EXIT_PARTITION_LOST)
            await coord.stop(0)
            return EXIT_PARTITION_LOST
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
