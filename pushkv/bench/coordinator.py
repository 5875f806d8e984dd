"""``pushkv bench coordinator``: rendezvous throughput, order latency and memory
per transfer, with simulated agents that move no bytes.

Processes (multiprocessing "spawn"; nothing gRPC lives in this controller):

* coordinator (`pushkv.bench.coordinator_server`): the real gRPC server, pinned to
  CPU 0 when the host has more than one, so the numbers describe "one core";
  it reports which build of the core (pure Python or compiled) it imported;
* agents (`pushkv.bench.coordinator_agents`): one process hosting both agent streams
  of a 1-prefill + 1-decode engine pair (TP 1); they report every WRITE done
  at once and move no bytes;
* clients (`pushkv.bench.coordinator_load`): ``--clients`` processes calling
  RegisterDecodeBlocks and ReportPrefillDone for each transfer, in random
  order, the second once the first was answered, at a fixed offered rate
  (open loop: a slow answer does not slow the offer).

Two modes, each on a fresh coordinator, in the same command (``--modes``):
unbatched (one call per RPC, one stream message per order and report) and
batched (each client submits what became due once per ``--step-ms``, like an
engine's scheduler step, as ``Submit`` calls of at most ``--batch``; the
agents accept CoordinatorBatch and send one AgentBatch per coordinator
message). The batch a Submit really carries is what became due in one step:
the table's calls/rpc column and the summary print it.

The offered rate rises step by step until the coordinator saturates
(COMPLETE rendezvous/s fall below 90 % of the offer, or the backlog does not
drain, in a step and in its ``--recheck`` reruns). How transfers are counted
and latency is timed: `pushkv.bench.coordinator_step` (only COMPLETE ones count;
latency from the send of the call that completed the rendezvous to the
order's receipt at the simulated agent, measured at half the saturation
rate). Finally a fresh coordinator holds ``--inflight`` transfers in
REGISTERED and its VmRSS growth is divided by their number.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from pushkv.bench.coordinator_report import final_line, header, print_profile, row, summary
from pushkv.bench.coordinator_runs import Bench, Memory, Run
from pushkv.bench.coordinator_workload import core_build

MODES = ("unbatched", "batched")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pushkv bench coordinator",
        description="rendezvous throughput, order latency and memory per transfer "
        "(simulated agents that move no bytes)",
    )
    p.add_argument("--quick", action="store_true", help="short steps (1-2 minutes in all)")
    p.add_argument("--clients", type=int, default=2, help="request-client processes")
    p.add_argument("--start-rate", type=float, default=300.0, help="first offered rate (/s)")
    p.add_argument("--factor", type=float, default=1.5, help="rate growth per step")
    p.add_argument("--max-rate", type=float, default=50_000.0)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument(
        "--refine",
        type=int,
        default=2,
        help="extra steps between the last rate sustained and the first saturated one",
    )
    p.add_argument(
        "--recheck",
        type=int,
        default=1,
        help="a saturated step runs again up to this many times before the ramp stops",
    )
    p.add_argument("--duration", type=float, default=8.0, help="seconds per step")
    p.add_argument("--drain-s", type=float, default=15.0, help="max wait for a backlog")
    p.add_argument("--max-outstanding", type=int, default=4000, help="per client")
    p.add_argument("--inflight", type=int, default=10_000, help="transfers held for RSS")
    p.add_argument(
        "--loaded-rate",
        type=float,
        default=200.0,
        help="rendezvous/s offered while --inflight transfers are held",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated runs, each on a fresh coordinator: unbatched, batched",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=256,
        help="most calls per Submit in the batched run, as the connector's client sends "
        "(0: no batched run)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=10.0,
        help="batched run: each client submits once per this period (an engine step)",
    )
    p.add_argument(
        "--batch-start-factor",
        type=float,
        default=5.0,
        help="the batched run starts at this many times --start-rate",
    )
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="cProfile the coordinator into FILE (FILE.batched for the batched run)",
    )
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--batched-only", action="store_true", help="same as --modes batched")
    p.add_argument("--unbatched-only", action="store_true", help="same as --modes unbatched")
    return p


def modes(args: argparse.Namespace) -> list[str]:
    """The runs to make, in order: --modes, narrowed by --*-only and --batch 0."""
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(MODES)})")
    if args.batched_only:
        wanted = [m for m in wanted if m == "batched"] or ["batched"]
    if args.unbatched_only:
        wanted = [m for m in wanted if m == "unbatched"] or ["unbatched"]
    if args.batch <= 0:
        wanted = [m for m in wanted if m != "batched"]
    if not wanted:
        raise SystemExit("no run left to make (--batch 0 with --modes batched?)")
    return [m for m in MODES if m in wanted]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 3.0)
        args.drain_s = min(args.drain_s, 6.0)
        args.inflight = min(args.inflight, 10_000)
        args.max_steps = min(args.max_steps, 8)
    todo = modes(args)
    bench = Bench(args, row)
    print(f"{core_build()} (controller; each coordinator process reports its own below)")
    print(
        f"coordinator CPUs {sorted(bench.coord_cpus or []) or 'any'}, "
        f"load CPUs {sorted(bench.load_cpus or []) or 'any'}, {args.clients} clients, "
        f"{args.duration:g} s per step, runs: {', '.join(todo)}"
    )
    print(header())
    t0 = time.monotonic()
    runs: list[Run] = []
    memory: Memory | None = None
    try:
        for mode in todo:
            batch = args.batch if mode == "batched" else 0
            prof = args.profile and (args.profile + (".batched" if batch else ""))
            runs.append(bench.throughput(batch, prof or None))
        memory = bench.memory()
    finally:
        bench.stop_all()
    print()
    for line in summary(runs, memory):
        print(line)
    print(f"elapsed {time.monotonic() - t0:.0f} s")
    if args.profile:
        for run in runs:
            print(f"\n({run.mode} run)")
            print_profile(args.profile + (".batched" if run.batch else ""), args.profile_top)
    print(final_line(runs, memory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
