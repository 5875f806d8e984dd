"""The coordinator's GC policy: long-lived objects leave the generations, cycles are still freed."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from controlplane import gcpolicy

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


async def test_full_collections_run_on_their_interval() -> None:
    full = asyncio.Event()

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.set()

    gc.callbacks.append(on_gc)
    task = asyncio.create_task(gcpolicy.full_collections(0.01))
    try:
        await asyncio.wait_for(full.wait(), WAIT)
    finally:
        task.cancel()
        gc.callbacks.remove(on_gc)
    assert gcpolicy.installed()


def test_uninstall_restores_the_defaults() -> None:
    gcpolicy.uninstall()
    assert not gcpolicy.installed()
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0
