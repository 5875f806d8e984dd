"""controlplane/metrics_merge.py: partitions' metric snapshots, through
their JSON form, merged as one coordinator's (the end-to-end figures:
tests/test_metrics.py::test_coordinator_metrics_after_real_transfers)."""

from __future__ import annotations

from pushkv.controlplane.metric_families import FamilyCopy
from pushkv.controlplane.metrics import EngineSnap, RankLease, Snapshot
from pushkv.controlplane.metrics_merge import merge_snapshots, snapshot_from_json, snapshot_to_json


def engine(name: str, inflight: int, orders: tuple[int, int]) -> EngineSnap:
    ranks = tuple(RankLease(name, r, True, 0.5, 4.0, n) for r, n in enumerate(orders))
    return EngineSnap(name, "prefill", 2, True, inflight, 2, 2, 0.5, 4.0, sum(orders), ranks)


def snap(inflight: int, orders: tuple[int, int], started: float, created: float) -> Snapshot:
    counter: FamilyCopy = [((), (started, created))]
    histogram: FamilyCopy = [(("decode_first",), ([1, 0, 2], 0.25, created))]
    return Snapshot(
        "c1",
        (engine("p0", inflight, orders),),
        (("awaiting", inflight), ("writing", 1)),
        [counter, histogram],
    )


def test_a_snapshot_survives_its_json_form() -> None:
    s = snap(3, (1, 2), 7.0, 100.0)
    assert snapshot_from_json(snapshot_to_json(s)) == s


def test_partitions_sum_their_own_and_share_the_registry_copy() -> None:
    parts = [
        snapshot_from_json(snapshot_to_json(s))
        for s in (snap(3, (1, 2), 7.0, 100.0), snap(2, (0, 5), 4.0, 90.0))
    ]
    own: list[FamilyCopy] = [
        [((), (0.0, 95.0))],
        [(("decode_first",), ([0, 1, 0], 0.5, 80.0))],
    ]
    merged = merge_snapshots(parts, own)
    (p0,) = merged.engines
    # Each partition's transfers and orders, summed; the registry's facts once.
    assert (p0.inflight, p0.open_orders) == (5, 8)
    assert [r.open_orders for r in p0.ranks] == [1, 7]
    assert (p0.registered, p0.connected, p0.tp_size) == (2, 2, 2)
    assert dict(merged.inflight) == {"awaiting": 5, "writing": 2}
    # Series by series, the earliest creation time kept.
    assert merged.events == [
        [((), (11.0, 90.0))],
        [(("decode_first",), ([2, 1, 4], 1.0, 80.0))],
    ]
    assert merged.coordinator_id == "c1"
