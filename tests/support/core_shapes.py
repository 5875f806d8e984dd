"""The core's two shapes for the core tests: one `Rendezvous`, or two
partitions behind one interface (controlplane/partitions.py). A test module
that imports `each_core_shape` runs every test on both; its helpers build
the core with `new_core`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from pushkv.controlplane.clock import Clock
from pushkv.controlplane.partitions import Core, make_core, partition_of
from pushkv.controlplane.settings import CoreSettings

_partitions = [1]  # the shape the running test asked for


@pytest.fixture(autouse=True, params=[1, 2], ids=["one-core", "two-partitions"])
def each_core_shape(request: pytest.FixtureRequest) -> Iterator[int]:
    _partitions[0] = request.param
    try:
        yield request.param
    finally:
        _partitions[0] = 1


def new_core(clock: Clock, max_order_bytes: int | None = None, **kw: Any) -> Core:
    """A core of the running test's shape, with settings `kw`."""
    kw.setdefault("partitions", _partitions[0])
    settings = CoreSettings(**kw)
    if max_order_bytes is None:
        return make_core(settings, clock)
    return make_core(settings, clock, max_order_bytes)


def ids_in_partition(i: int, n: int, k: int, prefix: str = "t") -> list[str]:
    """`n` transfer ids that all land in partition `i` of `k`."""
    ids = (f"{prefix}{j}" for j in itertools.count())
    return list(itertools.islice((t for t in ids if partition_of(t, k) == i), n))
