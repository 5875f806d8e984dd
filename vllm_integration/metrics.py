"""Prometheus metrics of the connector's worker half (the router's are in
pushkv/router/metrics.py).

Each object owns its registry (several workers may share a test process,
and vLLM's own metrics stay in the default registry).

Connector: a vLLM worker rank is a separate process from the API server
whose `/metrics` vLLM serves, so its counters cannot appear there. With
`metrics_port` set in `kv_connector_extra_config`, worker rank r serves them
on 0.0.0.0:(metrics_port + r); with 0 (the default) they are only counted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from pushkv.agent.events import EventKind

log = logging.getLogger("pushkv.metrics")

CONNECTOR_FALLBACK_REASONS = ("transfer_failed", "registration_failed")


def read_schedstat(pid: int) -> tuple[int, int] | None:
    """(run ns, run-queue wait ns) of the task `pid` from /proc/PID/schedstat;
    None where it is missing (not Linux, no schedstats, no such task)."""
    try:
        run_ns, wait_ns, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
        return int(run_ns), int(wait_ns)
    except (OSError, ValueError):
        return None


class ForwardThreadCollector(Collector):
    """Run and run-queue wait seconds of a process's main thread, read from
    ``/proc/PID/schedstat`` at each scrape. In a vLLM worker that thread runs the
    forward, so a wait that grows fast against the run time means other threads
    share its core (docs/operations.md, "Slow prefill"). Nothing where the file
    is missing (not Linux, or no schedstats)."""

    def __init__(self, engine_id: str, tp_rank: int, pid: int | None = None) -> None:
        self._labels = [engine_id, str(tp_rank)]
        self._pid = os.getpid() if pid is None else pid

    def collect(self) -> Iterator[Metric]:
        stat = read_schedstat(self._pid)
        if stat is None:
            return
        run_ns, wait_ns = stat
        for name, doc, ns in (
            (
                "pushkv_connector_forward_thread_run_seconds",
                "seconds the worker's main thread (vLLM's forward) ran on a CPU",
                run_ns,
            ),
            (
                "pushkv_connector_forward_thread_wait_seconds",
                "seconds the worker's main thread was runnable but waited for a CPU",
                wait_ns,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["engine", "rank"])
            family.add_metric(self._labels, ns / 1e9)
            yield family


class ConnectorCounts:
    """What the worker half counts, as plain ints.

    The engine thread is the only writer and bumps them with ``+=``: no lock,
    no call into prometheus_client on vLLM's engine loop. The collector below
    reads them at scrape time."""

    __slots__ = ("events", "failed", "fallbacks", "freed", "load_error_blocks", "ready")

    def __init__(self) -> None:
        self.ready = 0  # decode: transfers whose KV arrived
        self.failed = 0  # decode: transfers refused or failed
        self.load_error_blocks = 0  # decode: blocks reported as load errors
        self.freed = 0  # prefill: requests whose blocks were handed back
        self.events = dict.fromkeys(EventKind, 0)  # agent events by kind
        # decode, on_transfer_failure=recompute: failed loads vLLM recomputes, by reason
        self.fallbacks = dict.fromkeys(CONNECTOR_FALLBACK_REASONS, 0)


class _CountsCollector(Collector):
    _COUNTERS = (
        (
            "pushkv_connector_transfers_ready",
            "decode: transfers whose KV arrived (requests released to decode)",
            "ready",
        ),
        (
            "pushkv_connector_transfers_failed",
            "decode: transfers refused or failed (their blocks reported as load errors)",
            "failed",
        ),
        (
            "pushkv_connector_load_error_blocks",
            "decode: blocks reported to vLLM as load errors",
            "load_error_blocks",
        ),
        (
            "pushkv_connector_requests_freed",
            "prefill: requests whose KV blocks were handed back to vLLM",
            "freed",
        ),
    )

    def __init__(self, counts: ConnectorCounts, engine_id: str, tp_rank: int) -> None:
        self._counts = counts
        self._labels = [engine_id, str(tp_rank)]

    def collect(self) -> Iterator[Metric]:
        c = self._counts
        for name, doc, attr in self._COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["engine", "rank"])
            family.add_metric(self._labels, getattr(c, attr))
            yield family
        events = CounterMetricFamily(
            "pushkv_connector_agent_events",
            "events from the embedded agent, by kind (kv_ready, kv_failed, blocks_free)",
            labels=["engine", "rank", "kind"],
        )
        for kind, n in list(c.events.items()):
            events.add_metric([*self._labels, kind.value], n)
        yield events
        fallbacks = CounterMetricFamily(
            "pushkv_connector_fallbacks",
            "decode: requests whose KV did not arrive and that this engine computes "
            "itself (on_transfer_failure=recompute), by reason (transfer_failed: the "
            "transfer failed, expired or was cancelled; registration_failed: refused, "
            "or its outcome unknown while the coordinator was unreachable)",
            labels=["engine", "rank", "reason"],
        )
        for reason, n in list(c.fallbacks.items()):
            fallbacks.add_metric([*self._labels, reason], n)
        yield fallbacks


class ConnectorMetrics:
    """The worker half's counters (`counts`, bumped on the engine thread) and the
    forward thread's schedstat, labelled with the engine and TP rank."""

    def __init__(self, engine_id: str, tp_rank: int) -> None:
        self.registry = CollectorRegistry()
        self.tp_rank = tp_rank
        self.counts = ConnectorCounts()
        self.registry.register(_CountsCollector(self.counts, engine_id, tp_rank))
        self.registry.register(ForwardThreadCollector(engine_id, tp_rank))
        self._server: WSGIServer | None = None

    def serve(self, base_port: int) -> int | None:
        """Serve on 0.0.0.0:(base_port + rank) if base_port > 0; returns the port."""
        if base_port <= 0 or self._server is not None:
            return None
        port = base_port + self.tp_rank
        try:
            self._server, _ = start_http_server(port, "0.0.0.0", registry=self.registry)
        except OSError as exc:
            log.warning("pushkv connector metrics: cannot listen on port %d: %s", port, exc)
            return None
        return port

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
