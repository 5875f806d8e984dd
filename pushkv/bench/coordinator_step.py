"""One step of `pushkv bench coordinator` and the rules that turn its raw
records into figures.

* rendezvous/s: transfers that reached COMPLETE while the offer lasted,
  divided by how long it lasted. Issued, ordered or failed transfers do not
  count; neither do completions after the offer ended (a backlog's).
* order latency: from the client's send of the call that completed the
  rendezvous to the receipt of the order at the simulated prefill agent
  (CLOCK_MONOTONIC, shared by all processes of the host).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pushkv.bench.coordinator_load import ClientReport
from pushkv.bench.coordinator_workload import COMPLETE
from pushkv.bench.leader_metrics import LeaderShare

SATURATED = 0.9  # completed/offered below this ratio = saturated


@dataclass
class Step:
    offered: float
    issued: int = 0
    dropped: int = 0
    completed: int = 0  # reached COMPLETE, whenever
    completed_per_s: float = 0.0  # reached COMPLETE during the offer, per second of it
    failed: int = 0  # ended otherwise (FAILED, CANCELLED, EXPIRED)
    unfinished: int = 0  # both calls accepted, not ended when the drain gave up
    errors: dict[str, int] = field(default_factory=dict)
    order_ms: list[float] = field(default_factory=list)
    loop_lag_ms: list[float] = field(default_factory=list)  # the clients' (ClientReport)
    rpcs: int = 0
    calls: int = 0
    coord_cpu: float = 0.0
    drained: bool = True
    checked: int = 0  # transfers counted COMPLETE that the coordinator was asked about
    check_failed: int = 0  # ... and that it did not call COMPLETE
    leader: LeaderShare | None = None  # the leader's own share, from its /metrics

    @property
    def saturated(self) -> bool:
        return (not self.drained) or self.completed_per_s < SATURATED * self.offered

    @property
    def calls_per_rpc(self) -> float:
        return self.calls / self.rpcs if self.rpcs else float("nan")


def measure_step(
    offered: float,
    reports: Iterable[ClientReport],
    ordered: Mapping[str, float],
    ends: Mapping[str, tuple[float, int]],
) -> Step:
    """The figures of a step from its records.

    `reports`: the clients'; `ordered`: tid -> receipt of its order at the
    prefill agent; `ends`: tid -> (when it ended, its end state).
    """
    reports = list(reports)
    step = Step(offered=offered)
    sent: dict[str, float] = {}
    for r in reports:
        step.issued += r.issued
        step.dropped += r.dropped
        step.rpcs += r.rpcs
        step.calls += r.calls
        sent.update(r.sent)
        step.loop_lag_ms.extend(r.loop_lag_ms)
        for k, v in r.errors.items():
            step.errors[k] = step.errors.get(k, 0) + v
    if not reports:
        return step
    t_start = min(r.t0 for r in reports)
    t_end = max(r.t_end for r in reports)
    complete = [t for t, state in ends.values() if state == COMPLETE]
    step.completed = len(complete)
    step.failed = len(ends) - step.completed
    step.unfinished = sum(1 for tid in sent if tid not in ends)
    window = t_end - t_start
    in_window = sum(1 for t in complete if t_start <= t <= t_end)
    step.completed_per_s = in_window / window if window > 0 else 0.0
    step.order_ms = [(ordered[tid] - t) * 1000 for tid, t in sent.items() if tid in ordered]
    return step
