"""What `pushkv bench coordinator` prints: the step table, the summary and the
final key=value line, and the coordinator's cProfile tables."""

from __future__ import annotations

import io
import math
import pstats

from pushkv.bench.coordinator_runs import Memory, Run
from pushkv.bench.coordinator_step import Step
from pushkv.bench.stats import percentile

SETUP = (
    "simulated agents that move no bytes (1 prefill + 1 decode engine, TP 1), "
    "real gRPC over loopback, the coordinator pinned to one core"
)
RULES = (
    "rendezvous/s = transfers that reached COMPLETE during the offer, per second of it; "
    "order latency = send of the call that completed the rendezvous -> order received "
    "by the simulated prefill agent"
)


def header() -> str:
    return (
        f"{'':>9} {'offered/s':>9} {'issued':>7} {'complete/s':>10} {'calls/rpc':>9} "
        f"{'order_p50':>9} {'order_p99':>9} {'coordCPU':>8} {'dropped':>7} {'failed':>6} "
        f"{'drained':>7}  errors"
    )


def row(s: Step, label: str = "") -> None:
    errs = ",".join(f"{k}:{v}" for k, v in sorted(s.errors.items())) or "-"
    print(
        f"{label or 'step':>9} {s.offered:>9.0f} {s.issued:>7} {s.completed_per_s:>10.0f} "
        f"{s.calls_per_rpc:>9.1f} {percentile(s.order_ms, 50):>9.2f} "
        f"{percentile(s.order_ms, 99):>9.2f} {s.coord_cpu * 100:>7.0f}% {s.dropped:>7} "
        f"{s.failed + s.unfinished:>6} {'yes' if s.drained else 'NO':>7}  {errs}",
        flush=True,
    )


def describe(run: Run) -> str:
    """The mode as the summary names it: batched says its batch size."""
    if not run.batch:
        return "unbatched (1 call per RPC)"
    sat, half = run.saturation, run.half
    at_half = f", {half.calls_per_rpc:.0f} at half load" if half else ""
    return (
        f"batched (Submit of {sat.calls_per_rpc:.0f} calls per RPC on average at "
        f"saturation{at_half}; at most {run.batch})"
    )


def latency(s: Step | None) -> tuple[float, float]:
    """(p50, p99) order latency of a step, ms."""
    if s is None:
        return math.nan, math.nan
    return percentile(s.order_ms, 50), percentile(s.order_ms, 99)


def batched_over_unbatched(runs: list[Run]) -> float:
    """Saturation ratio of the two modes of the same command; nan without both."""
    by = {r.mode: r.saturation.completed_per_s for r in runs}
    if "batched" not in by or not by.get("unbatched"):
        return math.nan
    return by["batched"] / by["unbatched"]


def summary(runs: list[Run], memory: Memory | None) -> list[str]:
    out = [f"summary: {SETUP}", f"  {RULES}"]
    for run in runs:
        sat = run.saturation
        bound = "" if run.saturated else "at least "
        out.append(
            f"{describe(run)}: {bound}{sat.completed_per_s:.0f} rendezvous/s reached COMPLETE "
            f"(offered {sat.offered:.0f}/s, coordinator CPU {sat.coord_cpu * 100:.0f}%)"
        )
        if not run.saturated:
            out.append("  (a lower bound: the ramp ended at --max-steps or --max-rate unsaturated)")
        if run.half is not None:
            p50, p99 = latency(run.half)
            out.append(
                f"  order latency at {run.half.offered:.0f}/s: p50 {p50:.2f} ms, "
                f"p99 {p99:.2f} ms ({len(run.half.order_ms)} orders)"
            )
    ratio = batched_over_unbatched(runs)
    if not math.isnan(ratio):
        out.append(f"batched / unbatched: {ratio:.1f}x (same command, a fresh coordinator each)")
    steps = [s for r in runs for s in (*r.steps, *([r.half] if r.half else []))]
    checked = sum(s.checked for s in steps)
    wrong = sum(s.check_failed for s in steps)
    out.append(
        f"spot check: {checked - wrong}/{checked} sampled transfers counted COMPLETE are "
        f"COMPLETE per the coordinator (GetTransfer)" + ("  <-- MISCOUNTED" if wrong else "")
    )
    cores = sorted({r.core for r in runs} | ({memory.core} if memory else set()))
    out.append(f"{' / '.join(cores)} (as each coordinator process reported)")
    if memory is not None:
        out.append(
            f"memory: VmRSS {memory.before / 2**20:.1f} -> {memory.after / 2**20:.1f} MiB for "
            f"{memory.held} REGISTERED transfers = {memory.per_transfer:.0f} bytes each"
        )
        s = memory.loaded
        if s is not None:
            p50, p99 = latency(s)
            out.append(
                f"with {memory.held} transfers held: {s.offered:.0f}/s offered, {s.completed} "
                f"COMPLETE, {s.failed} failed, {s.unfinished} unfinished, drained={s.drained}, "
                f"order p50 {p50:.2f} ms, p99 {p99:.2f} ms"
            )
    return out


def final_line(runs: list[Run], memory: Memory | None) -> str:
    """One key=value line; it names the mode, the batch size and the agents."""
    parts = ["agents=simulated_no_bytes", "counted=COMPLETE", "latency_from=completing_send"]
    by = {r.mode: r for r in runs}
    for run in (by.get("batched"), by.get("unbatched")):
        if run is None:
            continue
        m, sat = run.mode, run.saturation
        p50, p99 = latency(run.half)
        if run.batch:
            parts += [f"batch_calls_per_rpc={sat.calls_per_rpc:.0f}", f"batch_max={run.batch}"]
        parts += [
            f"rendezvous_per_s_{m}={sat.completed_per_s:.0f}",
            f"saturated_{m}={'yes' if run.saturated else 'no_lower_bound'}",
            f"order_p50_ms_{m}={p50:.2f}",
            f"order_p99_ms_{m}={p99:.2f}",
        ]
    ratio = batched_over_unbatched(runs)
    if not math.isnan(ratio):
        parts.append(f"batched_over_unbatched={ratio:.1f}")
    if memory is not None:
        parts.append(f"bytes_per_inflight={memory.per_transfer:.0f}")
    return " ".join(parts)


def print_profile(path: str, top: int) -> None:
    for key, title in (("tottime", "by own time"), ("cumulative", "cumulative")):
        out = io.StringIO()
        stats = pstats.Stats(path, stream=out)
        stats.strip_dirs().sort_stats(key).print_stats(top)
        print(f"\ncoordinator profile (cProfile, {title}):")
        print("\n".join(out.getvalue().splitlines()[: top + 12]))
