"""What one rate and one system's run yield: percentiles, sustained or not, each
request's critical path (pushkv/bench/serving/critpath.py) and, for pushkv, the waits
of its transfers (the coordinator's timelines)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from pushkv.bench.serving.config import SUSTAINED_FRACTION
from pushkv.bench.serving.critpath import Event, Quantiles, quantiles, response_key
from pushkv.bench.serving.workload import ReqRecord
from pushkv.bench.stats import percentile


@dataclass
class RateResult:
    rate: float
    n: int
    ok: int
    failed: int
    timed_out: int
    offered_rps: float
    throughput_rps: float  # ok / (last finish - first send)
    completion_rps: float  # (ok - 1) / (last finish - first finish)
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms_p50: float
    sustained: bool
    errors: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    loadavg_before: float = math.nan  # 1-min load average of the whole box (noise)
    loadavg_after: float = math.nan
    # pushkv only: p50 / p99 (ms) of each stage of the request, from the coordinator's
    # per-transfer timeline matched to the client's clock (same host).
    stages_ms: dict[str, Quantiles] = field(default_factory=dict)
    # p50 / p99 (ms) of each stage of the critical path to the first token
    # (pushkv/bench/serving/critpath.py); the stages a system's logs allow.
    critpath_ms: dict[str, Quantiles] = field(default_factory=dict)
    # The fault scenario only (--kill-prefill-at): pushkv/bench/serving/fault.fault_summary.
    fault: dict[str, Any] = field(default_factory=dict)
    # Time to the second token, p50 / p90 / p99 (ms), as ttft_ms.
    ttst_ms: dict[str, float] = field(default_factory=dict)
    # The decode engine's (single: the engine's) prompt tokens by source during the
    # rate: local_compute, local_cache_hit, external_kv_transfer (vLLM's counter).
    decode_prompt_tokens: dict[str, float] = field(default_factory=dict)
    # CPU seconds used during the rate by each process group (engines, front,
    # coordinator) and by this load generator: where the 2 cores went.
    cpu_s: dict[str, float] = field(default_factory=dict)
    # Per engine: seconds its worker's main thread (the one that runs the forward)
    # ran, and waited in the run queue for its core while runnable (schedstat):
    # {"prefill": {"run": .., "wait": ..}, ...}. Waiting is time other threads took.
    worker_sched_s: dict[str, dict[str, float]] = field(default_factory=dict)
    # Mean per-request times (ms) from each engine's own histograms during the rate:
    # {"prefill": {"queue": .., "prefill": .., "decode": ..}, "decode": {...}}.
    engine_ms: dict[str, dict[str, float]] = field(default_factory=dict)


def summarize(rate: float, recs: Sequence[ReqRecord]) -> RateResult:
    """Percentiles over the successful requests, and whether the rate was sustained.

    Sustained: no failed or timed-out request, and the achieved throughput,
    ok / (last finish - first send), is at least 0.85 x the offered rate,
    (n - 1) / (last send - first send). A saturated system finishes requests at
    its capacity, below the arrival rate, while its queue grows; an unsaturated
    one loses only the last request's latency (a few %).
    """
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    ttst = [r.ttst * 1000 for r in ok if r.ttst is not None]
    tpot = [r.tpot * 1000 for r in ok if r.tpot is not None]
    e2e = [(r.last - r.sent) * 1000 for r in ok if r.last is not None]
    sent = [r.sent for r in recs]
    span = max(sent) - min(sent) if len(sent) > 1 else 0.0
    offered = (len(recs) - 1) / span if span > 0 else math.nan
    ends = sorted(r.last for r in ok if r.last is not None)
    makespan = ends[-1] - min(sent) if ends else 0.0
    throughput = len(ok) / makespan if makespan > 0 else 0.0
    finish_span = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    completion_rps = (len(ends) - 1) / finish_span if finish_span > 0 else math.nan
    failed = sum(1 for r in recs if r.error)
    timed_out = sum(1 for r in recs if r.timed_out)
    sustained = (
        failed == 0
        and timed_out == 0
        and len(ok) == len(recs)
        and not math.isnan(offered)
        and throughput >= SUSTAINED_FRACTION * offered
    )
    errors = sorted({r.error or "timed out" for r in recs if not r.ok})[:5]
    return RateResult(
        rate=rate,
        n=len(recs),
        ok=len(ok),
        failed=failed,
        timed_out=timed_out,
        offered_rps=offered,
        throughput_rps=throughput,
        completion_rps=completion_rps,
        ttft_ms={f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
        tpot_ms={f"p{q}": percentile(tpot, q) for q in (50, 90, 99)},
        e2e_ms_p50=percentile(e2e, 50),
        sustained=sustained,
        errors=errors,
        records=[asdict(r) for r in recs],
        ttst_ms={f"p{q}": percentile(ttst, q) for q in (50, 90, 99)},
    )


@dataclass
class SystemRun:
    system: str
    scenario: str
    error: str = ""
    startup_s: float = 0.0
    affinity: dict[str, dict[str, str]] = field(default_factory=dict)
    idle_cpu_percent: dict[str, float] = field(default_factory=dict)
    rates: list[RateResult] = field(default_factory=list)

    def at(self, rate: float) -> RateResult | None:
        return next((r for r in self.rates if r.rate == rate), None)


# =============================================================== pushkv timeline

STAGES: Final = (
    ("send->decode_registered", "sent", "decode_registered"),
    ("send->prefill_done", "sent", "prefill_done"),
    ("both->ordered", "both", "ordered"),
    ("ordered->write_done", "ordered", "write_done"),
    ("write_done->complete", "write_done", "complete"),
    ("complete->first_token", "complete", "first"),
    ("send->first_token", "sent", "first"),
)


def pushkv_stages(
    timelines: Mapping[str, Sequence[Event]], recs: Sequence[ReqRecord]
) -> dict[str, Quantiles]:
    """Where a pushkv request's TTFT goes, from the coordinator's transfer timelines
    (transfer id -> events; the router's transfer id is the X-Request-Id, so a
    streamed chunk's id is ``cmpl-<transfer id>``); unix times on this host."""
    samples: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for r in recs:
        ev = timelines.get(response_key(r))
        if ev is None or r.first_unix is None:
            continue
        at: dict[str, float] = {"sent": r.sent_unix, "first": r.first_unix}
        for stage, unix, _ in ev:
            if stage == "write_done":  # the last rank's
                at[stage] = max(at.get(stage, 0.0), unix)
            else:
                at.setdefault(stage, unix)
        if "decode_registered" in at and "prefill_done" in at:
            at["both"] = max(at["decode_registered"], at["prefill_done"])
        for name, a, b in STAGES:
            if a in at and b in at:
                samples[name].append((at[b] - at[a]) * 1000)
    return {name: quantiles(xs) for name, xs in samples.items() if xs}


def stages_text(stages: Mapping[str, Quantiles]) -> str:
    return ", ".join(f"{k} {v['p50']:.0f} / {v['p99']:.0f}" for k, v in stages.items())
