"""`pushkv bench hooks`: its command line, and the loads run one after another."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pushkv.bench.hooks.config import HookConfig
from pushkv.bench.hooks.engines import EngineFigures, quiet_env, run_load
from pushkv.bench.hooks.micro import micro
from pushkv.bench.hooks.report import compare_lines, final_line, load_header, print_profiles, report
from pushkv.bench.hooks.timer import timer_overhead
from pushkv.bench.output import say


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pushkv.bench.hooks",
        description="Time the pushkv connector's hooks on vLLM's engine thread (real "
        "Scheduler, real coordinator, real agents) with many requests in flight.",
    )
    ap.add_argument(
        "--load",
        choices=("both", "poisson", "closed"),
        default="both",
        help="open-loop Poisson arrivals, closed loop (waves), or both (default)",
    )
    ap.add_argument(
        "--rate", type=float, default=200.0, help="Poisson arrivals, requests/s (default 200)"
    )
    ap.add_argument(
        "--inflight",
        type=int,
        default=256,
        help="max_num_seqs; the closed loop keeps this many in flight (default 256)",
    )
    ap.add_argument("--requests", type=int, default=1024, help="transfers per load")
    ap.add_argument("--forward-ms", type=float, default=5.0)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument(
        "--idle-wait-ms", type=float, default=None, help="connector idle_wait_ms (default: its own)"
    )
    ap.add_argument("--deadline", type=float, default=180.0)
    ap.add_argument("--out", type=Path, help="write raw figures to DIR/bench_hooks.json")
    ap.add_argument(
        "--micro",
        action="store_true",
        help="only the warm per-call cost of the per-request hooks, in-process (~10 s)",
    )
    ap.add_argument(
        "--connector",
        choices=("both", "pushkv", "floor"),
        default="both",
        help="pushkv, the floor connector (pushkv's request flow with no work: what vLLM's "
        "calls into any Python connector cost here), or both, alternated (default)",
    )
    ap.add_argument(
        "--gc-off",
        action="store_true",
        help="diagnostic: no garbage collection in the engine and worker loops, to see "
        "its share of the tail (vLLM runs with it on; do not quote as the hooks' cost)",
    )
    ap.add_argument(
        "--profile",
        type=Path,
        help="cProfile every engine and worker loop into DIR and print the top pushkv "
        "frames (the timings of such a run are inflated; do not quote them)",
    )
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.rate <= 0:
        ap.error("--rate must be > 0")

    from pushkv.harness.coordinator import CoordinatorProcess
    from pushkv.harness.tiny_model import build_tiny_model

    model = build_tiny_model(Path(".cache/tiny-model"))
    if a.micro:
        quiet_env()
        for line in micro(str(model.resolve())):
            say(line)
        return 0
    loads = ("poisson", "closed") if a.load == "both" else (a.load,)
    connectors = ("pushkv", "floor") if a.connector == "both" else (a.connector,)
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
    wall_ns, cpu_ns = timer_overhead()
    results: dict[tuple[str, str], tuple[HookConfig, list[EngineFigures], dict[str, Any]]] = {}
    with CoordinatorProcess("--log-level", "WARNING") as coord:
        # Each load runs with pushkv, then right after with the floor (alternated).
        for load in loads:
            for connector in connectors:
                t0 = time.monotonic()
                cfg = HookConfig(
                    model_dir=str(model.resolve()),
                    coordinator=coord.address,
                    run_id=f"{os.getpid()}-{load}-{connector}",
                    inflight=a.inflight,
                    requests=a.requests,
                    forward_ms=a.forward_ms,
                    output_len=a.output_len,
                    max_batched_tokens=a.max_batched_tokens,
                    idle_wait_ms=a.idle_wait_ms,
                    deadline_s=a.deadline,
                    profile_dir=(
                        str((a.profile / f"{load}-{connector}").resolve()) if a.profile else ""
                    ),
                    rate=a.rate if load == "poisson" else 0.0,
                    gc_off=a.gc_off,
                    connector=connector,
                )
                if a.profile:
                    Path(cfg.profile_dir).mkdir(parents=True, exist_ok=True)
                figs = run_load(cfg)
                say(load_header(cfg, connector, time.monotonic() - t0))
                say(
                    f"timer overhead of one timed call (a no-op, median): wall "
                    f"{wall_ns / 1000:.2f} µs, thread CPU {cpu_ns / 1000:.2f} µs; a step times "
                    "10-20 calls"
                )
                lines, summary = report(figs)
                for line in lines:
                    say(line)
                say("")
                results[(load, connector)] = (cfg, figs, summary)
                if a.profile:
                    print_profiles(Path(cfg.profile_dir))
    summaries = {key: summary for key, (_, _, summary) in results.items()}
    for line in compare_lines(summaries, loads):
        say(line)
    say(final_line(summaries, loads))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        dump = {
            f"{load}/{connector}": {
                "config": cfg.__dict__,
                "summary": summary,
                "engines": [f.__dict__ for f in figs],
            }
            for (load, connector), (cfg, figs, summary) in results.items()
        }
        (a.out / "bench_hooks.json").write_text(json.dumps(dump, default=str))
    return 0 if all(not f.error for _, figs, _ in results.values() for f in figs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
