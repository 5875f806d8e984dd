"""The coordinator's event metrics: what it counts as transfers change.

`TransferMetrics` is a `TransferObserver` (controlplane/timeline.py): the
runtime calls `on_transfer_changed(t)` on the event loop after it applied a
change, and it reads the transfer's *new* timeline events, so every stage (and
every terminal state) is counted exactly once per transfer. It runs on every
change the leader applies, so it is part of the compiled core
(controlplane/core_build.py); serving and the scrape-time gauges stay in
controlplane/metrics.py.

The counters and histograms are plain Python numbers, updated without locks on
the event loop's thread, the one thread that changes transfers
(controlplane/metric_families.py). Labels stay bounded: states, reasons, WRITE
statuses, engine ids and ranks, never transfer ids.
"""

from __future__ import annotations

from collections.abc import Callable

from pushkv.controlplane.domain import RankState, State
from pushkv.controlplane.metric_families import CounterFamily, FamilyCopy, HistogramFamily
from pushkv.controlplane.timeline import TERMINAL_STAGES, Event, TimelineCursor, first
from pushkv.controlplane.transfer import Transfer

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
SIDE_STAGES = frozenset({"decode_registered", "prefill_done"})
# WRITE stage -> the status label of pushkv_write_reports_total.
WRITE_STAGES = {f"write_{r.value}": r.value for r in RankState}  # as rendezvous marks them


def _done_ranks(events: list[Event]) -> set[int]:
    return {r for s, _, r in events if s == "write_done"}


def _all_done(t: Transfer) -> bool:
    return all(rec.state is RankState.DONE for rec in t.orders.values())


class TransferMetrics:
    """Every event series of `pushkv_*`: counters and histograms, by transfer change."""

    def __init__(self, alive: Callable[[str], bool]) -> None:
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
        self.loop_lag_series = self.loop_lag.child()
        self.order_residence_series = self.order_residence.child()
        self._alive = alive
        self._cursor = TimelineCursor(alive)
        self._state: dict[str, State] = {}  # last state of each non-terminal transfer
        # Plain ints (no prometheus lock per change), exported at scrape time.
        self.inflight: dict[State, int] = dict.fromkeys(NON_TERMINAL, 0)

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
                self.inflight[old] -= 1
            if new is None:
                del self._state[tid]
            else:
                self.inflight[new] += 1
                self._state[tid] = new
        if events:
            self._observe(t, events)
        n = len(self._state)
        if n > 2048 and n > 2 * len(self._cursor):  # i.e. n > 2 * max(cursor, 1024)
            self._drop_vanished()

    def _drop_vanished(self) -> None:
        for tid in [tid for tid in self._state if not self._alive(tid)]:
            self.inflight[self._state.pop(tid)] -= 1

    def _observe(self, t: Transfer, new: list[Event]) -> None:
        ev = t.timeline
        arrived_side = wrote = False
        for stage, at, rank in new:
            if stage in SIDE_STAGES:
                arrived_side = True
            elif stage == "ordered":
                reg, pre = first(ev, "decode_registered"), first(ev, "prefill_done")
                if reg is not None and pre is not None:
                    self._order_latency.observe(max(at - max(reg, pre), 0.0))
            elif stage in WRITE_STAGES:
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
        if wrote and t.orders and _all_done(t):
            # Once per transfer: when this batch completed the set of DONE ranks.
            # (A rank's write_done is marked once, with its DONE state, which
            # stays: the timeline is read only once every rank is DONE.)
            done = _done_ranks(ev)
            if done.issuperset(t.orders) and not _done_ranks(ev[: len(ev) - len(new)]).issuperset(
                t.orders
            ):
                ordered = first(ev, "ordered")
                if ordered is not None:
                    last = max(at for s, at, _ in ev if s == "write_done")
                    self._write_time.observe(max(last - ordered, 0.0))

    def _observe_write(self, t: Transfer, stage: str, at: float, rank: int) -> None:
        status = WRITE_STAGES[stage]
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

    def copy_events(self) -> list[FamilyCopy]:
        """The event series now, family by family (on the loop, or from any thread)."""
        return [f.copy() for f in self.families]
