"""Garbage-collection policy for the process that runs the coordinator.

Every transfer leaves a dozen long-lived containers behind for the status API
(up to ``max_terminal`` of them, ``retention_s`` long). Python's cyclic GC
rescans all of them on each full collection, and with the default 25 % growth
rule a full collection comes every few seconds at 10k rendezvous/s: ~8 µs of
CPU per rendezvous and a pause of ~100 ms each time, growing with the heap.

Policy:
- whatever survives a generation-1 collection is frozen (``gc.freeze``), so
  full collections never rescan it. Frozen objects are still freed by
  reference counting the moment they are dropped; only garbage *cycles* among
  them wait;
- so a long-lived object is scanned twice (gen 0, gen 1) and then never
  again, and the generations stay small: gen 0 every 2 000 net allocations,
  gen 1 every other gen-0 pass. Pauses stay under ~1 ms (with gen 1 every
  10th pass of 10 000 they were 7-8 ms at 150 000 retained transfers);
- ``full_collections`` unfreezes and runs one full collection once the frozen
  objects have doubled since the last one (CPython's own rule for its oldest
  generation, at 100 % instead of 25 %). A pass costs about 22 ms per 100 000
  objects here: 0.96 s at the 100 000 retained TP-8 transfers `max_terminal`
  allows (4.2 million objects), with the loop, and the lease keeper's thread,
  held throughout. Doubling amortises it over as many new long-lived objects,
  and garbage cycles never hold more than the live heap. A coordinator whose
  retention is full keeps a steady frozen count (transfers leave as new ones
  come) and is paused by none; a fixed interval (every 10 minutes before)
  paused it for good;
- the policy looks only at a quiet moment: no transfer begun since the
  previous check (`activity`, read every second), so that no rendezvous
  waits behind the pause (0.33 s at 550 000 frozen objects on the bench's
  loaded leader, which found 35 objects to free: `pushkv bench cluster`,
  docs/benchmarks.md), nor behind the frozen count itself (CPython walks
  the frozen list to count it: 12 ms at 2 million objects). It looks at a
  quiet check at most every `LOOK_S`, and under a load that never pauses
  for a second every `MAX_DEFER_S`;
- a replica on etcd skips a pass it estimates (from the last pass's time per
  object) to take longer than a quarter of its lease TTL: a pause past the
  lease's margin would end its leadership (docs/reliability.md). The skip is
  logged (`gc_full_collection_skipped`) and the count to beat doubles again;
  garbage cycles among long-lived objects then wait (none were found in the
  measured runs).
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("pushkv.coordinator")

THRESHOLDS = (2_000, 1, 10)
# How often the frozen count (and the activity) is read, and the count below
# which no full collection is due (a pass over it costs ~55 ms here).
CHECK_INTERVAL_S = 1.0
MIN_BASELINE = 250_000
GROWTH = 2.0
# The frozen count is read, and a due pass run, at a quiet check at most
# every LOOK_S; while busy (a transfer begun since the previous check), every
# MAX_DEFER_S.
LOOK_S = 10.0
MAX_DEFER_S = 600.0
# A full pass's seconds per frozen object until one was timed (220-230 ns
# measured here).
FIRST_S_PER_OBJECT = 300e-9


def _freeze_survivors(phase: str, info: dict[str, Any]) -> None:
    # Survivors of a gen-1 pass are long-lived: park them outside the generations.
    if phase == "stop" and info["generation"] >= 1:
        gc.freeze()


def install() -> None:
    """Apply the policy to this process (idempotent)."""
    gc.set_threshold(*THRESHOLDS)
    if _freeze_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_survivors)


def uninstall() -> None:
    """Back to Python's defaults (tests; a process that embeds the coordinator)."""
    if _freeze_survivors in gc.callbacks:
        gc.callbacks.remove(_freeze_survivors)
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)


def installed() -> bool:
    return _freeze_survivors in gc.callbacks


def collect_all() -> tuple[int, float]:
    """One full collection over everything, frozen objects included.

    Returns (objects collected, seconds). The callback freezes the survivors again.
    """
    t0 = time.perf_counter()
    gc.unfreeze()
    found = gc.collect()
    return found, time.perf_counter() - t0


class FullCollections:
    """When a full collection is due: the frozen objects doubled since the last,
    and the pass fits `max_pause_s` by the last pass's time per object. Both
    are looked at only at a quiet check (`activity`, a count of the work a
    pause would hold up, did not move since the check before) `look_s` after
    the last look, or when `max_defer_s` passed since it."""

    def __init__(
        self,
        min_baseline: int = MIN_BASELINE,
        growth: float = GROWTH,
        max_pause_s: float = math.inf,
        max_defer_s: float = MAX_DEFER_S,
        look_s: float = LOOK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.min_baseline = min_baseline
        self.growth = growth
        self.max_pause_s = max_pause_s
        self.max_defer_s = max_defer_s
        self.look_s = look_s
        self.baseline = max(gc.get_freeze_count(), min_baseline)
        self.s_per_object = FIRST_S_PER_OBJECT
        self.runs = 0
        self.skipped = 0
        self.busy = 0  # checks that did not look: transfers were flowing
        # The coordinator's transfers begun (set once it runs); None: always quiet.
        self.activity: Callable[[], int] | None = None
        self._clock = clock
        self._seen: int | None = None
        self._looked_at = -math.inf  # the first check looks

    def due(self, frozen: int) -> bool:
        return frozen >= self.growth * self.baseline

    def _quiet(self) -> bool:
        """Whether nothing began since the previous check (read at every check)."""
        if self.activity is None:
            return True
        seen, self._seen = self._seen, self.activity()
        return seen == self._seen

    def check(self) -> bool:
        """Run one full collection if it is time to look (quiet and `look_s`
        since the last look, or `max_defer_s` since it), it is due, and it
        fits; whether it ran."""
        quiet = self._quiet()
        now = self._clock()
        waited = now - self._looked_at
        if waited < (self.look_s if quiet else self.max_defer_s):
            self.busy += not quiet
            return False
        self._looked_at = now
        frozen = gc.get_freeze_count()  # a walk over the frozen objects
        if not self.due(frozen):
            return False
        estimate = frozen * self.s_per_object
        if estimate > self.max_pause_s:
            self.skipped += 1
            self.baseline = frozen  # asked again once this heap doubled
            log.warning(
                "gc_full_collection_skipped",
                frozen=frozen,
                estimate_s=round(estimate, 3),
                max_pause_s=self.max_pause_s,
                detail="a full pass would hold the loop past the lease's margin",
            )
            return False
        found, took = collect_all()
        self.runs += 1
        self.s_per_object = took / max(frozen, 1)
        after = gc.get_freeze_count()
        self.baseline = max(after, self.min_baseline)
        (log.info if quiet else log.warning)(
            "gc_full_collection",
            collected=found,
            seconds=round(took, 3),
            frozen_before=frozen,
            frozen_after=after,
            quiet=quiet,
        )
        return True


async def full_collections(
    check_s: float = CHECK_INTERVAL_S, policy: FullCollections | None = None
) -> None:
    """Run ``policy.check`` every ``check_s`` until cancelled."""
    policy = policy or FullCollections()
    while True:
        await asyncio.sleep(check_s)
        policy.check()
