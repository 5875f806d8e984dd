"""Counters and histograms kept as plain Python numbers, exported as prometheus_client's.

The coordinator's event series (controlplane/metrics.py) change several times
per rendezvous on the event loop's thread; prometheus_client's `Counter.inc`
and `Histogram.observe` take a lock each time (docs/benchmarks.md: +35 µs per
rendezvous against +21 µs with these). So each series is a plain number
(`CountSeries`) or a list of per-bucket counts (`HistogramSeries`), per label
tuple, made on first use, and a collector exports them at scrape time through
prometheus_client's public custom-collector families (`CounterMetricFamily`,
`HistogramMetricFamily`), with the same names, types, help texts and samples
as its own metrics: `_total`, cumulative `_bucket{le}`, `_count`, `_sum`, and
`_created` unless prometheus_client was told not to export those.

Whatever prometheus_client decides (the text of `le`, whether `_created`
series are on) is read from a `Histogram` or `Counter` it builds, never from
its private state.

Only the event loop's thread adds series or changes them; `copy` may run on
another thread (a scrape whose loop did not answer): `dict(...)` of a dict and
`list(...)` of a list are single C-level copies under the GIL.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

_PROBE = "pushkv_probe"


def bucket_labels(buckets: Sequence[float]) -> tuple[str, ...]:
    """The `le` values prometheus_client writes for these bounds, "+Inf" last."""
    probe = Histogram(_PROBE, "", buckets=buckets, registry=None)
    return tuple(
        s.labels["le"] for m in probe.collect() for s in m.samples if s.name == f"{_PROBE}_bucket"
    )


def created_series() -> bool:
    """Whether prometheus_client exports `*_created` series now.

    Off with PROMETHEUS_DISABLE_CREATED_SERIES=true or after
    `prometheus_client.disable_created_metrics()`; read from a counter it builds.
    """
    probe = Counter(_PROBE, "", registry=None)
    return any(s.name == f"{_PROBE}_created" for m in probe.collect() for s in m.samples)


class CountSeries:
    """One counter series; `created` as prometheus_client sets it (first use)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value: float = 0.0
        self.created = time.time()

    def copy(self) -> tuple[float, float]:
        return self.value, self.created


class HistogramSeries:
    """One histogram series: per-bucket (not cumulative) counts, as prometheus_client keeps them."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # sorted, ending with +Inf
        self.counts = [0] * len(bounds)
        self.sum: float = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # The first bucket with amount <= bound, as prometheus_client's Histogram.observe.
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def copy(self) -> tuple[list[int], float, float]:
        return list(self.counts), self.sum, self.created


S = TypeVar("S", CountSeries, HistogramSeries)
# One family's series at one moment: (label values, series.copy()).
FamilyCopy = list[tuple[tuple[str, ...], Any]]


class _Family(Generic[S]):
    """A counter or histogram family: its series by label values, made on first use."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], make: Callable[[], S]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self._make: Callable[[], S] = make
        self.series: dict[tuple[str, ...], S] = {}
        if not labels:
            self.series[()] = make()

    def child(self, *values: str) -> S:
        s = self.series.get(values)
        if s is None:
            s = self.series[values] = self._make()
        return s

    def copy(self) -> FamilyCopy:
        return [(k, s.copy()) for k, s in dict(self.series).items()]


class CounterFamily(_Family[CountSeries]):
    def __init__(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> None:
        super().__init__(name, doc, labels, CountSeries)

    def export(self, series: FamilyCopy | None, created: bool) -> Metric:
        """The family with `series` as samples (none: for `describe`)."""
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for values, (value, at) in series or ():
            fam.add_metric(values, float(value), created=at if created else None)
        return fam


class HistogramFamily(_Family[HistogramSeries]):
    def __init__(
        self, name: str, doc: str, buckets: Sequence[float], labels: tuple[str, ...] = ()
    ) -> None:
        bounds = (*(float(b) for b in buckets), math.inf)
        self._le = bucket_labels(buckets)
        assert len(self._le) == len(bounds), (buckets, self._le)
        super().__init__(name, doc, labels, lambda: HistogramSeries(bounds))

    def export(self, series: FamilyCopy | None, created: bool) -> Metric:
        """The family with `series` as samples (none: for `describe`)."""
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for values, (counts, total, at) in series or ():
            acc = 0.0
            buckets = []
            for le, n in zip(self._le, counts, strict=True):
                acc += n
                buckets.append((le, acc))
            fam.add_metric(values, buckets, total)  # _bucket..., _count, _sum
            if created:
                labels = dict(zip(self.labels, values, strict=True))
                fam.add_sample(f"{self.name}_created", labels, at)
        return fam
