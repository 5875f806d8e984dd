"""The coordinator's GC policy: long-lived objects leave the generations, cycles are still freed."""

from __future__ import annotations

import asyncio
import gc
import math
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from pushkv.controlplane import gcpolicy

WAIT = 10.0


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


@pytest.fixture(autouse=True)
def policy() -> Iterator[None]:
    gcpolicy.install()
    try:
        yield
    finally:
        gcpolicy.uninstall()


def test_survivors_of_a_gen1_pass_are_frozen_and_still_freed_by_refcount() -> None:
    assert gc.get_threshold() == gcpolicy.THRESHOLDS
    plain = Node()
    ref = weakref.ref(plain)
    gc.collect(1)
    assert gc.get_freeze_count() > 0
    del plain
    assert ref() is None  # no collection needed


def test_a_frozen_cycle_waits_for_the_full_collection() -> None:
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    ref = weakref.ref(a)
    gc.collect(1)  # a and b survive: frozen
    del a, b
    gc.collect(1)
    gc.collect()  # a plain full collection does not look at frozen objects
    assert ref() is not None
    found, seconds = gcpolicy.collect_all()
    assert ref() is None
    assert found >= 2 and seconds >= 0
    assert gc.get_freeze_count() > 0  # the survivors are parked again


def test_a_full_collection_is_due_once_the_frozen_objects_doubled() -> None:
    """Not on a clock: a heap whose long-lived part stays the same size (a
    coordinator whose retention is full) is never paused by a full pass."""
    gc.collect(1)
    policy = gcpolicy.FullCollections(min_baseline=1_000, look_s=0)  # looks at every check
    start = gc.get_freeze_count()
    assert policy.baseline == max(start, 1_000)
    assert not policy.check() and policy.runs == 0
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    ref = weakref.ref(a)
    keep = [Node() for _ in range(policy.baseline)]  # the long-lived part doubles
    gc.collect(1)  # frozen, with the cycle
    del a, b
    assert policy.due(gc.get_freeze_count())
    assert policy.check() and policy.runs == 1
    assert ref() is None  # the frozen cycle was freed
    assert policy.baseline >= len(keep)  # the next one waits for this heap to double
    assert not policy.check() and policy.runs == 1
    assert not policy.due(int(1.9 * policy.baseline)) and policy.due(2 * policy.baseline)


def test_a_pass_longer_than_the_lease_allows_is_skipped() -> None:
    """A replica on etcd would lose its leadership to a pause past the lease's
    margin: a pass estimated longer than `max_pause_s` is skipped, and asked
    again only once the heap doubled again."""
    gc.collect(1)
    policy = gcpolicy.FullCollections(min_baseline=1_000, max_pause_s=1e-9, look_s=0)
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    ref = weakref.ref(a)
    keep = [Node() for _ in range(policy.baseline)]
    gc.collect(1)
    del a, b
    frozen = gc.get_freeze_count()
    assert policy.due(frozen)
    assert not policy.check()
    assert (policy.runs, policy.skipped) == (0, 1)
    assert ref() is not None  # the frozen cycle waits
    assert policy.baseline == frozen and not policy.check() and policy.skipped == 1
    policy.max_pause_s = math.inf  # a single coordinator: no lease to keep
    policy.baseline = len(keep) // 2
    assert policy.check() and ref() is None
    assert 0 < policy.s_per_object < 1e-3  # learned from the pass


async def test_full_collections_check_on_their_interval() -> None:
    full = asyncio.Event()

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.set()

    gc.callbacks.append(on_gc)
    policy = gcpolicy.FullCollections(min_baseline=1)
    policy.baseline = 0  # due at once
    task = asyncio.create_task(gcpolicy.full_collections(0.01, policy))
    try:
        await asyncio.wait_for(full.wait(), WAIT)
    finally:
        task.cancel()
        gc.callbacks.remove(on_gc)
    assert policy.runs >= 1
    assert gcpolicy.installed()


def test_uninstall_restores_the_defaults() -> None:
    gcpolicy.uninstall()
    assert not gcpolicy.installed()
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0


def test_while_transfers_flow_the_policy_looks_every_max_defer_s_only() -> None:
    """Transfers flowing (the count moved since the previous check): no pass,
    and not even the frozen count (CPython walks the frozen objects to count
    them), so no rendezvous waits behind either; a quiet check `look_s` after
    the last look runs a due pass, and a load that never pauses is looked at
    every `max_defer_s`."""
    now = [0.0]
    begun = [0]
    gc.collect(1)
    policy = gcpolicy.FullCollections(
        min_baseline=1_000, max_defer_s=60.0, look_s=10.0, clock=lambda: now[0]
    )
    policy.activity = lambda: begun[0]
    assert not policy.check()  # the first check looks: nothing due
    keep = [Node() for _ in range(2 * policy.baseline)]
    gc.collect(1)
    assert policy.due(gc.get_freeze_count())
    for _ in range(9):  # busy: a transfer began between each two checks
        begun[0] += 1
        now[0] += 1.0
        assert not policy.check()
    assert (policy.runs, policy.busy) == (0, 9)
    now[0] += 0.5
    assert not policy.check()  # quiet, but within look_s of the last look
    now[0] += 0.5
    assert policy.check() and policy.runs == 1  # quiet, 10 s since: looks, runs
    assert policy.baseline >= len(keep)

    more = [Node() for _ in range(2 * policy.baseline)]
    gc.collect(1)
    for _ in range(59):  # due again, and busy for a minute
        begun[0] += 1
        now[0] += 1.0
        assert not policy.check()
    begun[0] += 1
    now[0] += 1.0
    assert policy.check() and policy.runs == 2  # busy still, but 60 s since the last look
    assert len(more) > len(keep)
