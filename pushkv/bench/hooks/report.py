"""The hooks benchmark's report: per engine, each hook's and each step's times;
pushkv against the floor connector; the final line; cProfile summaries."""

from __future__ import annotations

import io
import math
import pstats
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from pushkv.bench.hooks.config import GOAL_US, SCHED_HOOKS, WORKER_HOOKS, HookConfig
from pushkv.bench.hooks.engines import EngineFigures
from pushkv.bench.output import say, table_head, table_row
from pushkv.bench.stats import percentile


def _us(ns: float) -> str:
    return "nan" if math.isnan(ns) else f"{ns / 1000:.1f}"


STEP_ROWS: Final = (
    ("scheduler/busy", "scheduler hooks, busy steps"),
    ("worker/busy", "worker hooks, busy steps"),
    ("all/busy", "all hooks, busy steps (wall)"),
    ("all-cpu/busy", "all hooks, busy steps (thread CPU)"),
    ("scheduler/idle", "scheduler hooks, idle steps"),
    ("worker/idle", "worker hooks, idle steps (incl. the idle wait)"),
    ("all/idle", "all hooks, idle steps (wall)"),
    ("all-cpu/idle", "all hooks, idle steps (thread CPU)"),
    ("all/busy-quiet", "busy steps where no request started or finished (wall)"),
    ("all-cpu/busy-quiet", "busy steps where no request started or finished (thread CPU)"),
    ("all/per-request-call", "other busy steps, all hooks / per-request hook calls (wall)"),
    ("all-cpu/per-request-call", "other busy steps, all hooks / per-request hook calls (CPU)"),
)


def _tail_breakdown(detail: Sequence[tuple[int, int, dict[str, int]]]) -> list[str]:
    """Where the slowest 1% of busy steps (at least 3) spent their hook time."""
    if not detail:
        return []
    ranked = sorted(detail, key=lambda d: d[0], reverse=True)
    tail = ranked[: max(3, len(ranked) // 100)]
    median = ranked[len(ranked) // 2]
    by_hook: dict[str, int] = defaultdict(int)
    for _, _, parts in tail:
        for name, ns in parts.items():
            by_hook[name] += ns
    total = sum(d[0] for d in tail) or 1
    top = sorted(by_hook.items(), key=lambda kv: kv[1], reverse=True)[:5]
    shares = ", ".join(f"{n} {100 * ns / total:.0f}%" for n, ns in top)
    return [
        "",
        f"slowest {len(tail)} busy steps: {_us(total / len(tail))} µs on average, "
        f"{sum(d[1] for d in tail) / len(tail):.1f} per-request hook calls each "
        f"(the median step: {median[1]}); by hook: {shares}",
    ]


def report(figs: Sequence[EngineFigures]) -> tuple[list[str], dict[str, Any]]:
    lines: list[str] = []
    summary: dict[str, Any] = {}
    for f in figs:
        lines.append("")
        lines.append(
            f"## {f.role} engine: {f.completed} requests completed, {f.failed} failed, "
            f"up to {f.max_inflight} in flight (running: {f.mean_inflight:.0f} on average "
            f"over busy steps), {f.wall_s:.1f} s" + (f"  ERROR: {f.error}" if f.error else "")
        )
        lines += table_head(
            "hook",
            "calls",
            "wall p50 (µs)",
            "wall p99 (µs)",
            "wall max (µs)",
            "CPU p50 (µs)",
            "CPU p99 (µs)",
        )
        for name in (*SCHED_HOOKS, *WORKER_HOOKS):
            calls, cpu = f.calls.get(name, []), f.cpu.get(name, [])
            if not calls:
                continue
            lines.append(
                table_row(
                    name,
                    len(calls),
                    _us(percentile(calls, 50)),
                    _us(percentile(calls, 99)),
                    _us(max(calls)),
                    _us(percentile(cpu, 50)),
                    _us(percentile(cpu, 99)),
                )
            )
        lines.append("")
        lines += table_head("per engine step", "steps", "p50 (µs)", "p99 (µs)", "max (µs)")
        s: dict[str, Any] = {}
        for key, label in STEP_ROWS:
            xs = f.steps.get(key, [])
            p50, p99 = percentile(xs, 50), percentile(xs, 99)
            lines.append(
                table_row(label, len(xs), _us(p50), _us(p99), _us(max(xs) if xs else math.nan))
            )
            s[key] = {"steps": len(xs), "p50_us": p50 / 1000, "p99_us": p99 / 1000}
        summary[f.role] = s
        lines.extend(_tail_breakdown(f.busy_detail))
    return lines, summary


def _worst(summary: dict[str, Any], key: str) -> float:
    return max((s[key]["p99_us"] for s in summary.values()), default=math.nan)


def load_header(cfg: HookConfig, connector: str, took_s: float) -> str:
    how = (
        f"Poisson arrivals at {cfg.rate:g} requests/s (open loop), max_num_seqs {cfg.inflight}"
        if cfg.rate > 0
        else f"closed loop, {cfg.inflight} requests in flight per engine"
    )
    who = (
        "pushkv connector hooks"
        if connector == "pushkv"
        else "floor connector hooks (the baseline: pushkv's request flow, no work)"
    )
    load = "poisson" if cfg.rate > 0 else "closed"
    return (
        f"# load: {load}, {who}. {how}; {cfg.requests} transfers, "
        f"prompts {cfg.min_prompt}-{cfg.max_prompt} tokens, block {cfg.block_size}, "
        f"simulated forward {cfg.forward_ms} ms; {took_s:.0f} s"
        + ("; garbage collection OFF (diagnostic)" if cfg.gc_off else "")
    )


# (summary key, label) of the rows compared against the floor
COMPARED: Final = (
    ("all/busy", "busy steps, all hooks (wall)"),
    ("all/busy-quiet", "busy steps that start or finish no request (wall)"),
    ("scheduler/busy", "busy steps, scheduler hooks only (wall)"),
)


def compare_lines(
    summaries: dict[tuple[str, str], dict[str, Any]], loads: Sequence[str]
) -> list[str]:
    """pushkv against the floor connector, per load, engine and figure (µs)."""
    lines = [
        "## pushkv against the floor connector (same loop, run right after it; µs wall)",
        *table_head(
            "load",
            "engine",
            "steps",
            "pushkv p50 / p99",
            "floor p50 / p99",
            "p99 ratio",
            "pushkv's own p99 (pushkv - floor)",
        ),
    ]
    for load in loads:
        push, floor = summaries.get((load, "pushkv")), summaries.get((load, "floor"))
        if push is None or floor is None:
            continue
        for engine in ("prefill", "decode"):
            for key, label in COMPARED:
                p, f = push.get(engine, {}).get(key), floor.get(engine, {}).get(key)
                if not p or not f or math.isnan(p["p99_us"]) or math.isnan(f["p99_us"]):
                    continue  # e.g. no quiet steps on a prefill engine
                lines.append(
                    table_row(
                        load,
                        engine,
                        label,
                        f"{p['p50_us']:.1f} / {p['p99_us']:.1f}",
                        f"{f['p50_us']:.1f} / {f['p99_us']:.1f}",
                        _ratio(p["p99_us"], f["p99_us"]),
                        f"{p['p99_us'] - f['p99_us']:.1f}",
                    )
                )
    return lines if len(lines) > 3 else []


def _ratio(a: float, b: float) -> str:
    return "nan" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}"


def final_line(summaries: dict[tuple[str, str], dict[str, Any]], loads: Sequence[str]) -> str:
    """Per load: the worse engine's busy-step p99 with pushkv and with the floor."""
    parts, verdicts = [], []
    for load in loads:
        push, floor = summaries.get((load, "pushkv")), summaries.get((load, "floor"))
        fields = []
        if push is not None:
            worst = _worst(push, "all/busy")
            fields += [
                f"hooks_p99_us_per_busy_step={worst:.1f}",
                f"cpu_p99_us={_worst(push, 'all-cpu/busy'):.1f}",
            ]
            verdicts.append(f"{load} {'met' if worst <= GOAL_US else 'missed'}")
        if floor is not None:
            fields.append(f"floor_p99_us={_worst(floor, 'all/busy'):.1f}")
        parts.append(f"{load}: " + " ".join(fields))
    verdict = f"; goal <= {GOAL_US:.0f}: {', '.join(verdicts)}" if verdicts else ""
    return f"{'; '.join(parts)} (wall, worse engine{verdict})"


def print_profiles(directory: Path, top: int = 12) -> None:
    for path in sorted(directory.glob("*.pstats")):
        buf = io.StringIO()
        stats = pstats.Stats(str(path), stream=buf)
        stats.sort_stats("tottime").print_stats(r"vllm_integration|agent/|queue|threading", top)
        say(f"\n### cProfile {path.stem} (tottime, pushkv and queue/threading frames)")
        body = buf.getvalue()
        start = body.find("   ncalls")
        say(body[start:].rstrip() if start >= 0 else body.rstrip())
