"""The coordinator's Prometheus metrics: what it counts, and /metrics.

`CoordinatorMetrics` is a `TransferObserver` (controlplane/timeline.py): the
runtime calls `on_transfer_changed(t)` on the event loop after it applied a
change, and it reads the transfer's *new* timeline events, so every stage (and
every terminal state) is counted exactly once per transfer. (Tracing, the
other observer of the kind, is controlplane/tracing.py.)

Labels stay bounded: states, reasons, WRITE statuses, engine ids and ranks
(engines are few and long-lived), never transfer ids.

The event counters and histograms are plain Python numbers, updated without
locks on the event loop's thread, the one thread that changes transfers
(controlplane/metric_families.py); one collector exports them when Prometheus
scrapes, through prometheus_client's public metric families, together with the
engine, lease and in-flight gauges computed at scrape time. The scrape thread
asks the event loop for one snapshot of both (the core is not thread-safe), so
a scrape is exact and consistent; if the loop does not answer, the event series
are copied from the scrape thread and the live gauges are left out.
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
from pushkv.protocol import PROTOCOL_VERSION

from controlplane.core_build import core_build
from controlplane.domain import RankState, State
from controlplane.leadership import Leadership
from controlplane.metric_families import (
    CounterFamily,
    FamilyCopy,
    HistogramFamily,
    created_series,
)
from controlplane.timeline import (
    TERMINAL_STAGES,
    Event,
    TimelineCursor,
    first,
)
from controlplane.transfer import Transfer
from wire.event_loop import sample_loop_lag

if TYPE_CHECKING:
    from controlplane.runtime import Runtime

# Which build of the core this process runs (controlplane/core_build.py).
_CORE = core_build()


log = structlog.get_logger("pushkv.coordinator")

# Seconds. Rendezvous waits span from "both at once" to the rendezvous timeout.
WAIT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# The coordinator's own reaction time: microseconds to milliseconds.
FAST_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
# The coordinator's own queueing (order residence, loop lag): FAST_BUCKETS
# made finer around the 2 ms order-latency goal (docs/reliability.md).
LATENCY_BUCKETS = (
    *(0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075),
    *(b for b in FAST_BUCKETS if b >= 0.01),
)
WRITE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    15.0,
)
BYTE_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 12))  # 4 KiB .. 4 GiB

NON_TERMINAL = tuple(s for s in State if not s.terminal)
_SIDE_STAGES = frozenset({"decode_registered", "prefill_done"})
# WRITE stage -> the status label of pushkv_write_reports_total.
_WRITE_STAGES = {f"write_{r.value}": r.value for r in RankState}  # as rendezvous marks them
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
    ranks: tuple[_RankLease, ...]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    coordinator_id: str
    engines: tuple[_EngineSnap, ...]
    inflight: tuple[tuple[str, int], ...]  # (state, transfers)
    events: list[FamilyCopy]  # CoordinatorMetrics.families, copied on the loop


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
        return [*self._m.export_events(None), *self._live(None)]

    def collect(self) -> Iterable[Metric]:
        snap = self._m.snapshot()
        # Without the loop's answer: the event series copied from this thread.
        events = snap.events if snap is not None else self._m.copy_events()
        return [*self._m.export_events(events), *self._live(snap)]

    @staticmethod
    def _live(snap: _Snapshot | None) -> Iterator[Metric]:
        """Engine, lease and in-flight gauges, read from the core."""
        info = InfoMetricFamily(
            "pushkv_coordinator",
            "this coordinator",
            labels=["coordinator_id", "protocol", "core"],
        )
        ready = GaugeMetricFamily(
            "pushkv_engine_ready",
            "1 when every rank is registered and leased",
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
                ready.add_metric([e.engine, e.role], 1.0 if e.ready else 0.0)
                connected.add_metric([e.engine, e.role], sum(r.connected for r in e.ranks))
                registered.add_metric([e.engine, e.role], len(e.ranks))
                inflight.add_metric([e.engine, e.role], e.inflight)
                for r in e.ranks:
                    labels = [e.engine, str(r.rank)]
                    seen.add_metric(labels, r.since_seen_s)
                    left.add_metric(labels, r.lease_left_s)
                    orders.add_metric(labels, r.open_orders)
        yield from (info, transfers, ready, connected, registered, inflight, seen, left, orders)


def _done_ranks(events: list[Event]) -> set[int]:
    return {r for s, _, r in events if s == "write_done"}


class CoordinatorMetrics:
    """Every `pushkv_*` metric of the coordinator, in a registry of its own."""

    def __init__(self, runtime: Runtime, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._rt = runtime
        self._loop = loop or asyncio.get_running_loop()
        self.registry = CollectorRegistry()
        self.started = CounterFamily(
            "pushkv_transfers_started", "transfers the coordinator created"
        )
        self.finished = CounterFamily(
            "pushkv_transfers_finished",
            "transfers that reached a terminal state, by state and reason",
            ("state", "reason"),
        )
        self.rendezvous_wait = HistogramFamily(
            "pushkv_rendezvous_wait_seconds",
            "gap between decode registration and prefill done; side = which came first",
            WAIT_BUCKETS,
            ("side",),
        )
        self.order_latency = HistogramFamily(
            "pushkv_order_latency_seconds",
            "from the second of (registration, prefill done) to the orders being issued",
            FAST_BUCKETS,
        )
        self.write_post = HistogramFamily(
            "pushkv_write_post_seconds",
            "per prefill rank: from the order to the agent's POSTED report",
            WRITE_BUCKETS,
        )
        self.write_completion = HistogramFamily(
            "pushkv_write_completion_seconds",
            "per prefill rank: from POSTED (or the order) to the DONE report",
            WRITE_BUCKETS,
        )
        self.write_time = HistogramFamily(
            "pushkv_transfer_write_seconds",
            "per transfer: from the order to the last rank's DONE report",
            WRITE_BUCKETS,
        )
        self.duration = HistogramFamily(
            "pushkv_transfer_duration_seconds",
            "per transfer: from creation to its terminal state",
            WAIT_BUCKETS,
            ("state",),
        )
        self.write_reports = CounterFamily(
            "pushkv_write_reports",
            "WRITE reports applied, by status (posted, done, failed, dropped)",
            ("status",),
        )
        self.write_bytes = CounterFamily(
            "pushkv_write_bytes",
            "bytes WRITTEN, as reported by the prefill agents, per prefill engine",
            ("engine",),
        )
        self.write_descriptors = CounterFamily(
            "pushkv_write_descriptors",
            "NIXL descriptors posted, as reported by the prefill agents, per prefill engine",
            ("engine",),
        )
        self.write_size = HistogramFamily(
            "pushkv_write_size_bytes",
            "bytes of one prefill rank's WRITE (DONE reports)",
            BYTE_BUCKETS,
        )
        self.order_residence = HistogramFamily(
            "pushkv_order_residence_seconds",
            "per order: from the step that issued it to its message handed to gRPC (the "
            "coordinator's own queueing; not the write itself or the network)",
            LATENCY_BUCKETS,
        )
        self.loop_lag = HistogramFamily(
            "pushkv_event_loop_lag_seconds",
            "how late the event loop ran a 5 ms timer (what a message read now waits "
            "before it is handled; up to 1 ms of it is epoll's millisecond timeout)",
            LATENCY_BUCKETS,
        )
        # Exported in this order (the order they were registered in before).
        self.families: tuple[CounterFamily | HistogramFamily, ...] = (
            self.started,
            self.finished,
            self.rendezvous_wait,
            self.order_latency,
            self.write_post,
            self.write_completion,
            self.write_time,
            self.duration,
            self.write_reports,
            self.write_bytes,
            self.write_descriptors,
            self.write_size,
            self.order_residence,
            self.loop_lag,
        )
        # Pre-create the bounded label sets so dashboards see zeros, not gaps.
        for side in ("decode_first", "prefill_first"):
            self.rendezvous_wait.child(side)
        # The unlabelled series, bound once.
        self._started = self.started.child()
        self._order_latency = self.order_latency.child()
        self._write_post = self.write_post.child()
        self._write_completion = self.write_completion.child()
        self._write_time = self.write_time.child()
        self._write_size = self.write_size.child()
        self._loop_lag = self.loop_lag.child()
        runtime.order_residence = self.order_residence.child().observe
        self._lag_task: asyncio.Task[None] | None = None
        self.registry.register(_Collector(self))
        self._cursor = TimelineCursor(self._alive)
        self._state: dict[str, State] = {}  # last state of each non-terminal transfer
        # Plain ints (no prometheus lock per change), exported at scrape time.
        self._inflight: dict[State, int] = dict.fromkeys(NON_TERMINAL, 0)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ serving
    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP; port 0 picks a free port. Returns the port."""
        server, thread = start_http_server(port, host, registry=self.registry)
        self._server, self._thread = server, thread
        bound: int = server.server_port
        log.info("metrics_listening", host=host, port=bound)
        lag = sample_loop_lag(self._loop_lag.observe)
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

    # ------------------------------------------------------------ observer
    def _alive(self, transfer_id: str) -> bool:
        return self._rt.core.has_transfer(transfer_id)

    def on_transfer_changed(self, t: Transfer) -> None:
        fresh, events = self._cursor.new_events(t)
        if fresh:
            self._started.value += 1
        # In-flight by state: the last state of each non-terminal transfer.
        tid = t.transfer_id
        old = self._state.get(tid)
        new = None if t.state.terminal else t.state
        if old is not new:
            if old is not None:
                self._inflight[old] -= 1
            if new is None:
                del self._state[tid]
            else:
                self._inflight[new] += 1
                self._state[tid] = new
        if events:
            self._observe(t, events)
        n = len(self._state)
        if n > 2048 and n > 2 * len(self._cursor):  # i.e. n > 2 * max(cursor, 1024)
            self._drop_vanished()

    def _drop_vanished(self) -> None:
        for tid in [tid for tid in self._state if not self._alive(tid)]:
            self._inflight[self._state.pop(tid)] -= 1

    def _observe(self, t: Transfer, new: list[Event]) -> None:
        ev = t.timeline
        arrived_side = wrote = False
        for stage, at, rank in new:
            if stage in _SIDE_STAGES:
                arrived_side = True
            elif stage == "ordered":
                reg, pre = first(ev, "decode_registered"), first(ev, "prefill_done")
                if reg is not None and pre is not None:
                    self._order_latency.observe(max(at - max(reg, pre), 0.0))
            elif stage in _WRITE_STAGES:
                self._observe_write(t, stage, at, rank)
                wrote = wrote or stage == "write_done"
            elif stage in TERMINAL_STAGES:
                self.finished.child(stage, t.reason.value).value += 1
                self.duration.child(stage).observe(max(at - t.created_wall, 0.0))
        if arrived_side:
            # Observed when the second of the two arrives (the first batch holding both).
            reg, pre = first(ev, "decode_registered"), first(ev, "prefill_done")
            if reg is not None and pre is not None:
                side = "decode_first" if pre >= reg else "prefill_first"
                self.rendezvous_wait.child(side).observe(abs(pre - reg))
        if wrote and t.orders:
            # Once per transfer: when this batch completed the set of DONE ranks.
            done = _done_ranks(ev)
            if done.issuperset(t.orders) and not _done_ranks(ev[: len(ev) - len(new)]).issuperset(
                t.orders
            ):
                ordered = first(ev, "ordered")
                if ordered is not None:
                    last = max(at for s, at, _ in ev if s == "write_done")
                    self._write_time.observe(max(last - ordered, 0.0))

    def _observe_write(self, t: Transfer, stage: str, at: float, rank: int) -> None:
        status = _WRITE_STAGES[stage]
        self.write_reports.child(status).value += 1
        ev = t.timeline
        if status == "posted":
            ordered = first(ev, "ordered")
            if ordered is not None:
                self._write_post.observe(max(at - ordered, 0.0))
            return
        rec = t.orders.get(rank)
        if rec is not None:
            engine = rec.order.prefill_engine_id
            if rec.bytes:
                self.write_bytes.child(engine).value += rec.bytes
            if rec.descriptors:
                self.write_descriptors.child(engine).value += rec.descriptors
        if status != "done":
            return
        if rec is not None:
            self._write_size.observe(rec.bytes)
        start = first(ev, "write_posted", rank)
        start = start if start is not None else first(ev, "ordered")
        if start is not None:
            self._write_completion.observe(max(at - start, 0.0))

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
            ranks = tuple(
                _RankLease(
                    eng.engine_id,
                    r,
                    a.connected,
                    max(now - a.last_seen, 0.0),
                    a.lease_deadline - now,
                    core.open_orders_of(a.key, a.incarnation),
                )
                for r, a in sorted(eng.ranks.items())
            )
            engines.append(
                _EngineSnap(
                    eng.engine_id,
                    eng.role.value,
                    eng.tp_size,
                    eng.ready,
                    core.inflight_for(eng.engine_id),
                    ranks,
                )
            )
        inflight = tuple((st.value, n) for st, n in self._inflight.items())
        return _Snapshot(core.coordinator_id, tuple(engines), inflight, self.copy_events())

    def copy_events(self) -> list[FamilyCopy]:
        """The event series now, family by family (on the loop, or from any thread)."""
        return [f.copy() for f in self.families]

    def export_events(self, copies: list[FamilyCopy] | None) -> list[Metric]:
        """The counter and histogram families; without `copies`, no samples (describe)."""
        created = created_series()
        if copies is None:
            return [f.export(None, created) for f in self.families]
        return [f.export(c, created) for f, c in zip(self.families, copies, strict=True)]
