"""``pushkv bench core --partitions K``: the state machine's rate over K processes.

The partitioned leader (docs/reliability.md, "Past one leader core", not
built) would run K partition processes, each with a `Runtime` of its own, and
give each transfer to one of them by its id. Its first question is whether
the state machine's rate grows with the processes at all, or whether
something shared (memory bandwidth, the allocator, the machine's cores)
caps it. This measures that, and nothing of the front tier that would route
messages to the partitions (its gRPC termination is most of today's leader
CPU: docs/benchmarks.md).

Each repetition runs, side by side in the same sitting:

* one process with ``--n`` rendezvous (the baseline), then
* K spawned processes with ``--n`` rendezvous each (their own transfer ids),
  released together by a barrier once each has imported and warmed up.

A process runs `bench core`'s repetition (`coordinator_core.run`, metrics and
logging as given). A figure is rendezvous over the wall-clock time from the
first process's start to the last one's end (CLOCK_MONOTONIC, shared by the
processes), and the ratio is the K-process rate over the one-process rate.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any, TextIO

from pushkv.bench.children import reap

BARRIER_S = 120.0  # every process imported and warmed up within this
RUN_S = 600.0  # and done this long after
POLL_S = 0.2  # how often a wait for a partition checks that it still runs


@dataclass(frozen=True)
class Rep:
    one_per_s: float  # the baseline: one process, n rendezvous
    k_per_s: float  # K processes, n each, together

    @property
    def ratio(self) -> float:
        return self.k_per_s / self.one_per_s


def _child(
    out: Connection, barrier: Barrier, part: int, n: int, batch: int, tp: int, metrics: bool
) -> None:
    from pushkv.bench import coordinator_core as core

    core.quiet_logs("WARNING")
    core.run(min(n, 256), batch, 1, metrics, tp=tp, prefix=f"warm{part}-")  # imports, caches
    barrier.wait(BARRIER_S)
    t0 = time.monotonic()
    core.run(n, batch, 1, metrics, tp=tp, prefix=f"p{part}-")
    out.send((t0, time.monotonic()))
    out.close()


def _together(k: int, n: int, batch: int, tp: int, metrics: bool) -> float:
    """Rendezvous per wall-clock second of `k` processes with `n` each."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(k)
    pipes, procs = [], []
    for part in range(k):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(send, barrier, part, n, batch, tp, metrics))
        p.start()
        send.close()
        pipes.append(recv)
        procs.append(p)
    try:
        spans: list[tuple[float, float]] = []
        deadline = time.monotonic() + BARRIER_S + RUN_S
        for recv, p in zip(pipes, procs, strict=True):
            # A process that failed sends nothing: its exit ends the wait.
            while not recv.poll(POLL_S):
                if not p.is_alive() and not recv.poll(0):
                    raise RuntimeError(f"a partition process failed (exit code {p.exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError("a partition process did not finish")
            spans.append(recv.recv())
    finally:
        reap(procs, 10)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"partition processes failed: exit codes {bad}")
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    return k * n / wall


def run(k: int, n: int, batch: int, reps: int, tp: int, metrics: bool) -> list[Rep]:
    return [
        Rep(_together(1, n, batch, tp, metrics), _together(k, n, batch, tp, metrics))
        for _ in range(reps)
    ]


def report(k: int, reps: Sequence[Rep], out: TextIO | Any = sys.stdout) -> float:
    """Print each repetition and the medians; returns the median ratio."""
    for i, r in enumerate(reps):
        out.write(
            f"  rep {i + 1}: 1 process {r.one_per_s:8.0f}/s, {k} processes "
            f"{r.k_per_s:8.0f}/s, ratio {r.ratio:.2f}\n"
        )
    ratio = statistics.median(r.ratio for r in reps)
    one = statistics.median(r.one_per_s for r in reps)
    many = statistics.median(r.k_per_s for r in reps)
    out.write(
        f"partitions={k} rendezvous_per_s={many:.0f} one_process_per_s={one:.0f} "
        f"ratio={ratio:.2f}\n"
    )
    return ratio
