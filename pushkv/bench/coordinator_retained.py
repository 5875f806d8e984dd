"""`pushkv bench core --retained N`: what the terminal transfers a coordinator
keeps for the status API (`--retention-s`, `--max-terminal`) cost it.

One `Runtime` is driven through N rendezvous as `pushkv bench core` drives it
(every transfer COMPLETE), with retention long enough to keep all of them,
under the coordinator's GC policy (controlplane/gcpolicy.py). Then: the
GC-tracked objects each retained transfer holds (the frozen count's growth
over N), the process's resident memory, and the time of full GC passes over
that heap (`gcpolicy.collect_all`, what `full_collections` runs), each of
which holds the interpreter: the coordinator's event loop and its lease
keeper's thread (docs/operations.md, "Garbage collection in the coordinator").
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from pushkv.bench import coordinator_core as core
from pushkv.controlplane import gcpolicy

PASSES = 3
KEEP_S = 86_400.0  # retention long enough to keep every transfer


@dataclass(frozen=True, slots=True)
class Retained:
    transfers: int
    tp: int
    objects: int  # frozen objects the transfers added
    rss_bytes: int
    pass_s: tuple[float, ...]

    @property
    def per_transfer(self) -> float:
        return self.objects / max(self.transfers, 1)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(n: int, tp: int, batch: int, with_metrics: bool, passes: int = PASSES) -> Retained:
    was_installed = gcpolicy.installed()
    gcpolicy.install()
    try:
        # One small run first: what the code itself allocates for good (modules,
        # caches) is frozen before the count starts.
        asyncio.run(core._one_rep(batch, batch, with_metrics, 0, tp, prefix="warm-"))
        gc.collect(1)
        before = gc.get_freeze_count()
        keep: list[Any] = []
        settings = {"retention_s": KEEP_S, "max_terminal": n}
        asyncio.run(core._one_rep(n, batch, with_metrics, 1, tp, keep=keep, settings=settings))
        rt = keep[0]
        held = sum(1 for _ in rt.core.transfers())
        if held != n:
            raise RuntimeError(f"{held} transfers retained, expected {n}")
        gc.collect(1)  # the survivors are frozen, as the policy does
        objects = gc.get_freeze_count() - before
        rss = _rss_bytes()
        times = tuple(gcpolicy.collect_all()[1] for _ in range(passes))
        del rt, keep
        return Retained(n, tp, objects, rss, times)
    finally:
        if not was_installed:
            gcpolicy.uninstall()


def report(r: Retained, out: Any = sys.stdout) -> None:
    ms = [t * 1000 for t in r.pass_s]
    med = statistics.median(ms)
    out.write(
        f"retained {r.transfers} TP-{r.tp} transfers: {r.per_transfer:.1f} GC-tracked objects "
        f"each ({r.objects} in all), RSS {r.rss_bytes / 2**20:.0f} MiB; a full GC pass "
        f"{med:.0f} ms median ({', '.join(f'{m:.0f}' for m in ms)}) over the whole heap\n"
    )
    out.write(
        f"retained={r.transfers} objects_per_transfer={r.per_transfer:.1f} "
        f"rss_mib={r.rss_bytes / 2**20:.0f} full_pass_ms={med:.0f}\n"
    )
