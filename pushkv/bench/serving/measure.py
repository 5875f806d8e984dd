"""One system in one scenario: deploy it, warm it up, run every rate, measure.

Each system's servers start once per scenario and run all rates (a start costs
about a minute on a 2-core box, so alternating systems per rate would cost more
than the measurements). Around each rate it records where the CPU went, how
long each engine's forward thread waited for its core, the engines' own
per-request times and, for pushkv, the stages of its requests.
"""

from __future__ import annotations

import os
import time

from pushkv.bench.output import say
from pushkv.bench.serving import critpath
from pushkv.bench.serving.config import LABELS, BenchConfig
from pushkv.bench.serving.deployment import LOOPBACK, Deployment, Placement, deploy
from pushkv.bench.serving.fault import PrefillKiller, fault_lines, fault_summary, router_fallbacks
from pushkv.bench.serving.processes import (
    cpu_ticks,
    engine_means_ms,
    engine_time_sums,
    idle_cpu_percent,
    pgid_pids,
    prompt_tokens_by_source,
    thread_affinity,
    worker_schedstat,
)
from pushkv.bench.serving.results import (
    RateResult,
    SystemRun,
    pushkv_stages,
    stages_text,
    summarize,
)
from pushkv.bench.serving.workload import (
    make_workload,
    run_load,
    warm_prefix_cache,
    warmup_workload,
)


def start_deployment(
    cfg: BenchConfig, run: SystemRun, placement: Placement = LOOPBACK
) -> Deployment | None:
    """Deploy, twice at most: ports come from free_port(), another process may take one first."""
    tag = f"[{run.scenario}] {run.system}"
    for attempt in (1, 2):
        try:
            dep = deploy(cfg, run.system, run.scenario, placement)
        except (RuntimeError, TimeoutError, OSError) as exc:
            lines = str(exc).splitlines() or [""]
            cause = [ln for ln in lines[1:] if "Error" in ln or "error:" in ln][-1:]
            why = " ".join(["start failed:", lines[0], *cause])[:400]
            say(f"{tag}: {why} (attempt {attempt} of 2)")
            run.error = why
        else:
            run.error = ""
            return dep
    return None


def _worker_cores(affinity: dict[str, str]) -> str:
    """The allowed cores of an engine's worker processes (TP ranks: one entry)."""
    return " ".join(v for k, v in sorted(affinity.items()) if k.startswith("VLLM::Worker")) or "?"


def run_system(
    cfg: BenchConfig, system: str, scenario: str, placement: Placement = LOOPBACK
) -> SystemRun:
    run = SystemRun(system, scenario)
    t0 = time.monotonic()
    where = "" if placement is LOOPBACK else f", on the {placement.name}"
    say(f"[{scenario}] {system}: starting ({LABELS[system]}{where}) ...")
    dep = start_deployment(cfg, run, placement)
    if dep is None:
        return run
    try:
        run.startup_s = round(time.monotonic() - t0, 1)
        run.affinity = {name: thread_affinity(g) for name, g in dep.pgids().items()}
        # Warm-up through the front: handshakes and first-request costs, not measured.
        recs = run_load(dep.front_url, warmup_workload(cfg), cfg.output_len, cfg.timeout_s)
        bad = [r.error or "timed out" for r in recs if not r.ok]
        if bad:
            run.error = f"warm-up failed: {bad[0]}"
            say(f"[{scenario}] {system}: {run.error}")
            return run
        run.idle_cpu_percent = idle_cpu_percent(dep.pgids())
        say(
            f"[{scenario}] {system}: up in {run.startup_s:.0f} s; worker affinity "
            f"{ {n: _worker_cores(a) for n, a in run.affinity.items()} }; "
            f"idle CPU % {run.idle_cpu_percent}"
        )
        for i, rate in enumerate(cfg.rates):
            res = _run_rate(cfg, dep, scenario, i, rate)
            run.rates.append(res)
            _say_rate(rate, res)
            time.sleep(1.0)  # let the engines go idle between rates
        return run
    finally:
        dep.stop()


def _run_rate(cfg: BenchConfig, dep: Deployment, scenario: str, i: int, rate: float) -> RateResult:
    wl = make_workload(cfg, scenario, i, rate)
    if scenario == "prefixhit":
        errs = warm_prefix_cache(dep.warm_url, wl.prompts, cfg.timeout_s)
        if errs:
            say(f"  warming {dep.warm_url} failed for {len(errs)} prompts: {errs[0]}")
    load0 = os.getloadavg()[0]
    tokens0 = prompt_tokens_by_source(dep.warm_url)
    times0 = {sv.name: engine_time_sums(sv.url) for sv in dep.servers}
    groups = {name: pgid_pids(g) for name, g in dep.all_pgids().items()}
    cpu0 = {name: cpu_ticks(p) for name, p in groups.items()}
    sched0 = {name: worker_schedstat(p) for name, p in groups.items()}
    self0 = os.times()
    killer = None
    if cfg.kill_prefill_at_s is not None:
        killer = PrefillKiller(dep, cfg.kill_prefill_at_s)
        killer.start()
    recs = run_load(dep.front_url, wl, cfg.output_len, cfg.timeout_s)
    if killer is not None:
        killer.cancel()
    hz = os.sysconf("SC_CLK_TCK")
    res_cpu = {name: round((cpu_ticks(p) - cpu0[name]) / hz, 2) for name, p in groups.items()}
    self1 = os.times()
    res_cpu["load generator"] = round(self1.user + self1.system - self0.user - self0.system, 2)
    res = summarize(rate, recs)
    res.loadavg_before, res.loadavg_after = load0, os.getloadavg()[0]
    res.cpu_s = res_cpu
    for name, p in groups.items():
        (r0, w0), (r1, w1) = sched0[name], worker_schedstat(p)
        if r1 > r0:
            res.worker_sched_s[name] = {
                "run": round((r1 - r0) / 1e9, 2),
                "wait": round((w1 - w0) / 1e9, 2),
            }
    res.engine_ms = {
        sv.name: engine_means_ms(times0[sv.name], engine_time_sums(sv.url)) for sv in dep.servers
    }
    tokens1 = prompt_tokens_by_source(dep.warm_url)
    res.decode_prompt_tokens = {k: v - tokens0.get(k, 0.0) for k, v in tokens1.items()}
    timelines = critpath.fetch_timelines(dep.coordinator) if dep.coordinator else {}
    if timelines:
        res.stages_ms = pushkv_stages(timelines, recs)
    if critpath.paths_of(dep.system):
        front = critpath.fetch_front_timings(dep.front_url)
        res.critpath_ms = critpath.critical_path(dep.system, recs, front, timelines)
    if killer is not None:
        res.fault = fault_summary(recs, killer.killed_at, router_fallbacks(dep.front_url))
    return res


def _say_rate(rate: float, res: RateResult) -> None:
    say(
        f"  rate {rate:g}/s: {res.ok}/{res.n} ok, {res.failed} failed, "
        f"{res.timed_out} timed out; {res.throughput_rps:.2f} req/s; "
        f"TTFT p50 {res.ttft_ms['p50']:.0f} ms p99 {res.ttft_ms['p99']:.0f} ms; "
        f"TPOT p50 {res.tpot_ms['p50']:.1f} ms; load avg {res.loadavg_before:.1f}"
        + ("" if res.sustained else "  (not sustained)")
        + (f"  errors: {res.errors[:2]}" if res.errors else "")
    )
    say(f"    decode-side prompt tokens by source: {res.decode_prompt_tokens}")
    say(f"    CPU seconds during the rate: {res.cpu_s}")
    say(
        "    worker main thread (the forward), seconds run / waited for its core: "
        + ", ".join(f"{n} {v['run']:.2f} / {v['wait']:.2f}" for n, v in res.worker_sched_s.items())
    )
    say(f"    engine-side mean times (ms): {res.engine_ms}")
    if res.critpath_ms:
        say("    critical path, p50 / p99 (ms): " + critpath.text(res.critpath_ms))
    if res.stages_ms:
        say("    pushkv transfer stages, p50 / p99 (ms): " + stages_text(res.stages_ms))
    if res.fault:
        for line in fault_lines(res.fault):
            say(line)
