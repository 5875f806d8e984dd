"""What the connector's worker half counts, and how it reaches vLLM's /metrics
(the router's metrics are in pushkv/router/metrics.py).

Every worker rank counts in plain ints on its engine thread (`ConnectorCounts`:
no lock, no call into prometheus_client on vLLM's engine loop). vLLM asks the
connector for its stats after every step (`get_kv_connector_stats`): each
rank hands back what it counted since it last answered (`StepStats.take`),
vLLM adds the ranks' answers up in the engine core and sends them to the API
server, which adds them to its counters (vllm_integration/stats.py) and
serves them on its own `/metrics`, with the rank as a label.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from pushkv.agent.events import EventKind

CONNECTOR_FALLBACK_REASONS = ("transfer_failed", "registration_failed")
# How often a step's stats read the forward thread's schedstat (one small
# /proc read on the engine thread): its counters move in steps this long.
SCHEDSTAT_EVERY_S = 1.0


def read_schedstat(pid: int) -> tuple[int, int] | None:
    """(run ns, run-queue wait ns) of the task `pid` from /proc/PID/schedstat;
    None where it is missing (not Linux, no schedstats, no such task)."""
    try:
        run_ns, wait_ns, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
        return int(run_ns), int(wait_ns)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class Counted:
    """One thing a rank counts: its key in the stats vLLM carries, and the
    Prometheus counter it adds to (exposed as `metric`_total)."""

    key: str
    metric: str
    doc: str
    label: tuple[str, str] | None = None  # (name, value) that tells it from its siblings
    scale: float = 1.0  # counted units per the counter's (ns: 1e-9 s)


_EVENTS_DOC = "events from the embedded agent, by kind (kv_ready, kv_failed, blocks_free)"
_FALLBACKS_DOC = (
    "decode: requests whose KV did not arrive and that this engine computes itself "
    "(on_transfer_failure=recompute), by reason (transfer_failed: the transfer failed, "
    "expired or was cancelled; registration_failed: refused, or its outcome unknown while "
    "the coordinator was unreachable)"
)

COUNTED: tuple[Counted, ...] = (
    Counted(
        "ready",
        "pushkv_connector_transfers_ready",
        "decode: transfers whose KV arrived (requests released to decode)",
    ),
    Counted(
        "failed",
        "pushkv_connector_transfers_failed",
        "decode: transfers refused or failed (their blocks reported as load errors)",
    ),
    Counted(
        "load_error_blocks",
        "pushkv_connector_load_error_blocks",
        "decode: blocks reported to vLLM as load errors",
    ),
    Counted(
        "freed",
        "pushkv_connector_requests_freed",
        "prefill: requests whose KV blocks were handed back to vLLM",
    ),
    *(
        Counted(f"event:{k.value}", "pushkv_connector_agent_events", _EVENTS_DOC, ("kind", k.value))
        for k in EventKind
    ),
    *(
        Counted(f"fallback:{r}", "pushkv_connector_fallbacks", _FALLBACKS_DOC, ("reason", r))
        for r in CONNECTOR_FALLBACK_REASONS
    ),
    Counted(
        "run_ns",
        "pushkv_connector_forward_thread_run_seconds",
        "seconds the worker's main thread (vLLM's forward) ran on a CPU",
        scale=1e-9,
    ),
    Counted(
        "wait_ns",
        "pushkv_connector_forward_thread_wait_seconds",
        "seconds the worker's main thread was runnable but waited for a CPU",
        scale=1e-9,
    ),
)


class ConnectorCounts:
    """What the worker half counts, as plain ints.

    The engine thread is the only writer and bumps them with ``+=``: no lock,
    no call into prometheus_client on vLLM's engine loop."""

    __slots__ = ("events", "failed", "fallbacks", "freed", "load_error_blocks", "ready")

    def __init__(self) -> None:
        self.ready = 0  # decode: transfers whose KV arrived
        self.failed = 0  # decode: transfers refused or failed
        self.load_error_blocks = 0  # decode: blocks reported as load errors
        self.freed = 0  # prefill: requests whose blocks were handed back
        self.events = dict.fromkeys(EventKind, 0)  # agent events by kind
        # decode, on_transfer_failure=recompute: failed loads vLLM recomputes, by reason
        self.fallbacks = dict.fromkeys(CONNECTOR_FALLBACK_REASONS, 0)

    def totals(self) -> tuple[int, ...]:
        """Every count but the schedstat ones, in COUNTED's order."""
        return (
            self.ready,
            self.failed,
            self.load_error_blocks,
            self.freed,
            *self.events.values(),
            *self.fallbacks.values(),
        )


class StepStats:
    """One rank's counts as vLLM collects them: what changed since the last
    `take`. Runs on the engine thread, after every step."""

    def __init__(self, counts: ConnectorCounts, pid: int | None = None) -> None:
        self.counts = counts
        self._pid = os.getpid() if pid is None else pid
        self._sent = tuple(0 for _ in counts.totals())  # counted from the start
        self._sched_sent = (0, 0)  # run and wait ns already counted
        self._sched_due = 0.0  # monotonic: when schedstat is read next

    def take(self) -> dict[str, int] | None:
        """The counts since the last call, by COUNTED key (only those that
        moved), or None when none did."""
        now = self.counts.totals()
        sent, self._sent = self._sent, now
        out: dict[str, int] = {}
        if now != sent:
            for c, n, was in zip(COUNTED, now, sent, strict=False):
                if n != was:
                    out[c.key] = n - was
        t = time.monotonic()
        if t >= self._sched_due:
            self._sched_due = t + SCHEDSTAT_EVERY_S
            stat = read_schedstat(self._pid)
            if stat is not None:
                (run, wait), (run0, wait0) = stat, self._sched_sent
                self._sched_sent = stat
                if run > run0:
                    out["run_ns"] = run - run0
                if wait > wait0:
                    out["wait_ns"] = wait - wait0
        return out or None
