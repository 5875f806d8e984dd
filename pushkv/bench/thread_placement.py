"""How late a pushkv-like thread wakes when it shares a busy compute core
(`python -m pushkv.bench.thread_placement`): thread_cpus "inherit" against "auto"
(agent/placement.py), side by side in one run.

Each trial is a fresh child process whose main thread is bound to core 0, as
vLLM-CPU binds a worker's engine thread. It starts one thread under the
placement, which sleeps a fixed period again and again and records how late
each wake came (the link's watchdog does the same, every 0.1 s). Core 0 is
kept busy by a hog process bound to it (a compute thread that holds no GIL, as
vLLM's OpenMP threads hold none); with --busy-other, so is every other core
(every core computes, as two TP engines on this 2-core machine).

What it leaves out: the agent's real work (one thread that only sleeps), the
GIL (the compute is in another process), and the engine's own threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from pushkv.agent.placement import cgroup_cpus
from pushkv.bench.stats import percentile

HOG = "while True: pass"

TRIAL = """
import json, os, sys, threading, time
from pushkv.agent.placement import placed, resolve
os.sched_setaffinity(0, {0})
period, seconds, setting = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
late = []
def sleeper():
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        due = time.monotonic() + period
        time.sleep(period)
        late.append(time.monotonic() - due)
with placed(resolve(setting, cpu_engine=True)):  # as a vLLM-CPU worker
    t = threading.Thread(target=sleeper)
    t.start()
t.join()
print(json.dumps(late))
"""


def trial(setting: str, period_s: float, seconds: float) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-c", TRIAL, str(period_s), str(seconds), setting],
        check=True,
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    )
    late: list[float] = json.loads(out.stdout)
    return late


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="trials of each setting, alternating")
    ap.add_argument("--seconds", type=float, default=3.0, help="one trial's length")
    ap.add_argument("--period-ms", type=float, default=5.0, help="the thread's sleep")
    ap.add_argument("--busy-other", action="store_true", help="hog every other core too")
    args = ap.parse_args(argv)
    cpus = sorted(cgroup_cpus())
    if len(cpus) < 2 or 0 not in cpus:
        raise SystemExit(f"needs CPU 0 and another; the cgroup allows {cpus}")
    busy = cpus if args.busy_other else [0]
    hogs = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", HOG]) for c in busy]
    results: dict[str, list[tuple[float, float, float]]] = {"inherit": [], "auto": []}
    try:
        time.sleep(0.5)  # the hogs running before the first trial
        for _ in range(args.runs):
            for setting, rows in results.items():
                ms = [x * 1000 for x in trial(setting, args.period_ms / 1000, args.seconds)]
                rows.append((percentile(ms, 50), percentile(ms, 99), max(ms)))
    finally:
        for h in hogs:
            h.kill()
            h.wait(10)
    print(
        f"CPUs {cpus}; core 0 busy{', every other core busy' if args.busy_other else ''}; "
        f"a {args.period_ms:g} ms sleep, {args.seconds:g} s a trial, {args.runs} trials each "
        f"(alternating); lateness of a wake in ms, medians of the trials (each trial's figure)"
    )
    for setting, rows in results.items():
        cols = []
        for i, name in enumerate(("p50", "p99", "max")):
            each = [r[i] for r in rows]
            cols.append(
                f"{name} {statistics.median(each):.3f} ({', '.join(f'{x:.3f}' for x in each)})"
            )
        print(f"{setting:8s} " + "  ".join(cols))
    for i, name in enumerate(("p50", "p99")):
        a = statistics.median(r[i] for r in results["auto"])
        b = statistics.median(r[i] for r in results["inherit"])
        print(f"inherit/auto {name}: {b / a:.1f}" if a > 0 else f"auto {name} is 0")


if __name__ == "__main__":
    main()
