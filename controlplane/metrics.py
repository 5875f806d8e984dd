"""The coordinator's Prometheus metrics: what it counts, and /metrics.

`CoordinatorMetrics.events` (controlplane/transfer_metrics.py, part of the
compiled core) is the runtime's `TransferObserver`: it counts every stage of
every transfer once, in plain Python numbers updated on the event loop.
(Tracing, the other observer of the kind, is controlplane/tracing.py.) This
module serves them: one collector exports them when Prometheus scrapes,
through prometheus_client's public metric families, together with the engine,
lease and in-flight gauges computed at scrape time. The scrape thread asks the
event loop for one snapshot of both (the core is not thread-safe), so a scrape
is exact and consistent; if the loop does not answer, the event series are
copied from the scrape thread and the live gauges are left out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric

from pushkv.controlplane.core_build import core_build
from pushkv.controlplane.leadership import Leadership
from pushkv.controlplane.metric_families import FamilyCopy, created_series
from pushkv.controlplane.transfer_metrics import TransferMetrics
from pushkv.net.event_loop import sample_loop_lag
from pushkv.protocol import PROTOCOL_VERSION

if TYPE_CHECKING:
    from pushkv.controlplane.runtime import Runtime

# Which build of the core this process runs (controlplane/core_build.py).
_CORE = core_build()


log = structlog.get_logger("pushkv.coordinator")

SNAPSHOT_TIMEOUT_S = 2.0


# ------------------------------------------------------------ scrape-time gauges


@dataclass(frozen=True, slots=True)
class _RankLease:
    engine: str
    rank: int
    connected: bool
    since_seen_s: float
    lease_left_s: float
    open_orders: int


@dataclass(frozen=True, slots=True)
class _EngineSnap:
    engine: str
    role: str
    tp_size: int
    ready: bool
    inflight: int
    # Over the engine's ranks: how many hold a lease and an open stream, the
    # longest silence, the shortest lease left, the open orders.
    registered: int
    connected: int
    seen_max_s: float
    lease_min_s: float
    open_orders: int
    ranks: tuple[_RankLease, ...]  # empty without the per-rank series


@dataclass(frozen=True, slots=True)
class _Snapshot:
    coordinator_id: str
    engines: tuple[_EngineSnap, ...]
    inflight: tuple[tuple[str, int], ...]  # (state, transfers)
    events: list[FamilyCopy]  # TransferMetrics.families, copied on the loop


class LeadershipCollector:
    """This replica's role and its leader's term (controlplane/leadership.py)."""

    def __init__(self, gate: Leadership) -> None:
        self._gate = gate

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        view = self._gate.view
        leader = GaugeMetricFamily(
            "pushkv_coordinator_leader",
            "1 while this replica serves writes (the leader, or the single coordinator)",
            labels=["role"],
        )
        leader.add_metric([view.role.value], 1.0 if self._gate.serving_writes else 0.0)
        term = GaugeMetricFamily(
            "pushkv_coordinator_leader_term",
            "the leader's term as this replica knows it (etcd create revision; 0 single)",
        )
        term.add_metric([], float(view.term))
        return [leader, term]


class _Collector:
    """Every family of the coordinator, from one snapshot taken at scrape time."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self._m = metrics

    def describe(self) -> Iterable[Metric]:
        return [*self._m.export_events(None), *self._live(None, self._m.rank_series)]

    def collect(self) -> Iterable[Metric]:
        snap = self._m.snapshot()
        # Without the loop's answer: the event series copied from this thread.
        events = snap.events if snap is not None else self._m.copy_events()
        return [*self._m.export_events(events), *self._live(snap, self._m.rank_series)]

    @staticmethod
    def _live(snap: _Snapshot | None, rank_series: bool) -> Iterator[Metric]:
        """Engine, lease and in-flight gauges, read from the core."""
        info = InfoMetricFamily(
            "pushkv_coordinator",
            "this coordinator",
            labels=["coordinator_id", "protocol", "core"],
        )
        ready = GaugeMetricFamily(
            "pushkv_engine_ready",
            "1 when every rank is registered and connected (or within its reconnect grace)",
            labels=["engine", "role"],
        )
        connected = GaugeMetricFamily(
            "pushkv_agents_connected",
            "agent ranks with an open stream, per engine",
            labels=["engine", "role"],
        )
        registered = GaugeMetricFamily(
            "pushkv_agents_registered",
            "agent ranks holding a lease (connected or not), per engine",
            labels=["engine", "role"],
        )
        inflight = GaugeMetricFamily(
            "pushkv_engine_inflight_transfers",
            "non-terminal transfers involving the engine",
            labels=["engine", "role"],
        )
        seen_max = GaugeMetricFamily(
            "pushkv_engine_agent_last_seen_max_seconds",
            "seconds since the engine's most silent rank's last message (lease health)",
            labels=["engine", "role"],
        )
        left_min = GaugeMetricFamily(
            "pushkv_engine_agent_lease_remaining_min_seconds",
            "seconds until the first of the engine's rank leases expires unless renewed",
            labels=["engine", "role"],
        )
        open_orders = GaugeMetricFamily(
            "pushkv_engine_open_orders",
            "orders sent to the engine's ranks and not resolved yet",
            labels=["engine", "role"],
        )
        seen = GaugeMetricFamily(
            "pushkv_agent_last_seen_seconds",
            "seconds since the agent rank's last message (lease health)",
            labels=["engine", "rank"],
        )
        left = GaugeMetricFamily(
            "pushkv_agent_lease_remaining_seconds",
            "seconds until the agent rank's lease expires unless renewed",
            labels=["engine", "rank"],
        )
        orders = GaugeMetricFamily(
            "pushkv_agent_open_orders",
            "orders sent to the agent rank and not resolved yet",
            labels=["engine", "rank"],
        )
        transfers = GaugeMetricFamily(
            "pushkv_transfers_inflight", "non-terminal transfers by state", labels=["state"]
        )
        if snap is not None:
            info.add_metric([snap.coordinator_id, str(PROTOCOL_VERSION), _CORE], {})
            for state, n in snap.inflight:
                transfers.add_metric([state], n)
            for e in snap.engines:
                labels = [e.engine, e.role]
                ready.add_metric(labels, 1.0 if e.ready else 0.0)
                connected.add_metric(labels, e.connected)
                registered.add_metric(labels, e.registered)
                inflight.add_metric(labels, e.inflight)
                open_orders.add_metric(labels, e.open_orders)
                if e.registered:
                    seen_max.add_metric(labels, e.seen_max_s)
                    left_min.add_metric(labels, e.lease_min_s)
                for r in e.ranks:
                    rank_labels = [e.engine, str(r.rank)]
                    seen.add_metric(rank_labels, r.since_seen_s)
                    left.add_metric(rank_labels, r.lease_left_s)
                    orders.add_metric(rank_labels, r.open_orders)
        yield from (info, transfers, ready, connected, registered, inflight)
        yield from (seen_max, left_min, open_orders)
        if rank_series:
            yield from (seen, left, orders)


class CoordinatorMetrics:
    """Every `pushkv_*` metric of the coordinator, in a registry of its own."""

    def __init__(
        self,
        runtime: Runtime,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        rank_series: bool = True,
    ) -> None:
        self._rt = runtime
        self._loop = loop or asyncio.get_running_loop()
        # The three pushkv_agent_* series per rank (--rank-metrics): a scrape of
        # 1,000 ranks took about 56 ms of the coordinator's interpreter with
        # them and 24 without (docs/operations.md); the per-engine aggregates stay.
        self.rank_series = rank_series
        self.registry = CollectorRegistry()
        self.events = TransferMetrics(runtime.core.has_transfer)
        runtime.order_residence = self.events.order_residence_series.observe
        self._lag_task: asyncio.Task[None] | None = None
        self.registry.register(_Collector(self))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ serving
    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP; port 0 picks a free port. Returns the port."""
        server, thread = start_http_server(port, host, registry=self.registry)
        self._server, self._thread = server, thread
        bound: int = server.server_port
        log.info("metrics_listening", host=host, port=bound)
        lag = sample_loop_lag(self.events.loop_lag_series.observe)
        self._lag_task = self._loop.create_task(lag, name="loop-lag")
        return bound

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server is not None else None

    async def close(self) -> None:
        task, self._lag_task = self._lag_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.shutdown)
            server.server_close()

    # ------------------------------------------------------------ scrape
    def snapshot(self) -> _Snapshot | None:
        """Engines and leases, read on the event loop (from any thread)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return self._take()
        if self._loop.is_closed() or not self._loop.is_running():
            return None
        fut: concurrent.futures.Future[_Snapshot] = concurrent.futures.Future()

        def fill() -> None:
            try:
                fut.set_result(self._take())
            except Exception as exc:
                fut.set_exception(exc)

        self._loop.call_soon_threadsafe(fill)
        try:
            return fut.result(SNAPSHOT_TIMEOUT_S)
        except Exception:
            log.warning("metrics_snapshot_failed", exc_info=True)
            return None

    def _take(self) -> _Snapshot:
        core = self._rt.core
        now = self._rt.clock.monotonic()
        engines = []
        for eng in core.engines():
            ranks = [
                _RankLease(
                    eng.engine_id,
                    r,
                    a.connected,
                    max(now - a.last_seen, 0.0),
                    a.lease_deadline - now,
                    core.open_orders_of(a.key, a.incarnation),
                )
                for r, a in sorted(eng.ranks.items())
            ]
            engines.append(
                _EngineSnap(
                    eng.engine_id,
                    eng.role.value,
                    eng.tp_size,
                    eng.ready,
                    core.inflight_for(eng.engine_id),
                    len(ranks),
                    sum(r.connected for r in ranks),
                    max((r.since_seen_s for r in ranks), default=0.0),
                    min((r.lease_left_s for r in ranks), default=0.0),
                    sum(r.open_orders for r in ranks),
                    tuple(ranks) if self.rank_series else (),
                )
            )
        inflight = tuple((st.value, n) for st, n in self.events.inflight.items())
        return _Snapshot(core.coordinator_id, tuple(engines), inflight, self.copy_events())

    def copy_events(self) -> list[FamilyCopy]:
        """The event series now, family by family (on the loop, or from any thread)."""
        return self.events.copy_events()

    def export_events(self, copies: list[FamilyCopy] | None) -> list[Metric]:
        """The counter and histogram families; without `copies`, no samples (describe)."""
        created = created_series()
        if copies is None:
            return [f.export(None, created) for f in self.events.families]
        return [f.export(c, created) for f, c in zip(self.events.families, copies, strict=True)]
