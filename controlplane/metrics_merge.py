"""The coordinator's metrics with its state in partition processes
(`--partition-procs K`): each partition takes its own snapshot
(metrics.CoordinatorMetrics.snapshot: its engines, its in-flight transfers,
its event series) and sends it to the front as JSON (never pickle); the
front merges them into one snapshot, which its /metrics exports with the
same code and the same families as one coordinator's.

How each part merges:
- the engine registry is the same copy in every partition (every hello goes
  to each): partition 0's, with each engine's in-flight transfers and each
  rank's open orders summed over the partitions (each holds its own);
- the in-flight transfers by state: summed;
- the counters and histograms: summed series by series (a series' creation
  time: the earliest); the front's own (its event loop's lag) are added in.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from pushkv.controlplane.metric_families import FamilyCopy
from pushkv.controlplane.metrics import EngineSnap, RankLease, Snapshot


def snapshot_to_json(snap: Snapshot) -> str:
    return json.dumps(dataclasses.asdict(snap))


def snapshot_from_json(text: str) -> Snapshot:
    doc = json.loads(text)
    engines = tuple(
        EngineSnap(**{**e, "ranks": tuple(RankLease(**r) for r in e["ranks"])})
        for e in doc["engines"]
    )
    inflight = tuple((str(st), int(n)) for st, n in doc["inflight"])
    events = [[(tuple(labels), _series(copy)) for labels, copy in fam] for fam in doc["events"]]
    return Snapshot(doc["coordinator_id"], engines, inflight, events)


def _series(copy: list[Any]) -> Any:
    """A series' copy as metric_families made it: a counter's (value,
    created), a histogram's (counts, sum, created)."""
    if isinstance(copy[0], list):
        return list(copy[0]), float(copy[1]), float(copy[2])
    return float(copy[0]), float(copy[1])


def merge_snapshots(snaps: Sequence[Snapshot], own_events: list[FamilyCopy]) -> Snapshot:
    """The partitions' snapshots (partition 0 first) as one coordinator's,
    with the front's own event series (`own_events`) added in."""
    first = snaps[0]
    inflight_of: dict[str, int] = {}
    engine_orders: dict[str, int] = {}
    orders_of: dict[tuple[str, int], int] = {}
    for s in snaps:
        for e in s.engines:
            inflight_of[e.engine] = inflight_of.get(e.engine, 0) + e.inflight
            engine_orders[e.engine] = engine_orders.get(e.engine, 0) + e.open_orders
            for r in e.ranks:
                key = (e.engine, r.rank)
                orders_of[key] = orders_of.get(key, 0) + r.open_orders
    engines = tuple(
        dataclasses.replace(
            e,
            inflight=inflight_of[e.engine],
            open_orders=engine_orders[e.engine],
            ranks=tuple(
                dataclasses.replace(r, open_orders=orders_of[(e.engine, r.rank)]) for r in e.ranks
            ),
        )
        for e in first.engines
    )
    by_state: dict[str, int] = {}
    for s in snaps:
        for state, n in s.inflight:
            by_state[state] = by_state.get(state, 0) + n
    families = [own_events, *(s.events for s in snaps)]
    events = [_merge_family([f[i] for f in families]) for i in range(len(own_events))]
    return Snapshot(first.coordinator_id, engines, tuple(by_state.items()), events)


def _merge_family(copies: Sequence[FamilyCopy]) -> FamilyCopy:
    merged: dict[tuple[str, ...], Any] = {}
    for copy in copies:
        for labels, series in copy:
            have = merged.get(labels)
            merged[labels] = series if have is None else _add(have, series)
    return list(merged.items())


def _add(a: Any, b: Any) -> Any:
    if len(a) == 3:  # a histogram's per-bucket counts, sum, created
        counts = [x + y for x, y in zip(a[0], b[0], strict=True)]
        return counts, a[1] + b[1], min(a[2], b[2])
    return a[0] + b[0], min(a[1], b[1])


__all__ = ["merge_snapshots", "snapshot_from_json", "snapshot_to_json"]
