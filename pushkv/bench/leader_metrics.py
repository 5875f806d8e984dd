"""The leader's own share of the order latency, read from its /metrics.

`pushkv bench cluster` runs each replica with ``--metrics-port`` and scrapes
the leader before and after a step. The difference of two scrapes of a
histogram is that step's histogram; its quantiles are estimated from the
buckets as Prometheus's ``histogram_quantile`` does (linear within a bucket),
so they are as coarse as the buckets (controlplane/metrics.py,
``LATENCY_BUCKETS``).

* ``pushkv_order_residence_seconds``: per order, from the step that issued it
  to its message built for the agent's stream (the leader's own queueing).
* ``pushkv_event_loop_lag_seconds``: how late the leader's event loop ran a
  5 ms timer, i.e. what a message read from a socket waits before the leader
  handles it.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RESIDENCE = "pushkv_order_residence_seconds"
LOOP_LAG = "pushkv_event_loop_lag_seconds"
SCRAPE_TIMEOUT_S = 10.0

# A histogram as cumulative counts per upper bound, ascending (+Inf last).
Buckets = list[tuple[float, float]]


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, Buckets]:
    """The unlabelled histograms of the coordinator's /metrics at `port`."""
    url = f"http://{host}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
        text = r.read().decode()
    out: dict[str, Buckets] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "histogram":
            continue
        rows = [
            (float(s.labels["le"]), s.value)
            for s in fam.samples
            if s.name.endswith("_bucket") and set(s.labels) == {"le"}
        ]
        if rows:
            out[fam.name] = sorted(rows)
    return out


def delta(before: Buckets, after: Buckets) -> Buckets:
    """What was observed between two scrapes of one histogram."""
    was = dict(before)
    return [(le, n - was.get(le, 0.0)) for le, n in after]


def quantile(buckets: Buckets, q: float) -> float:
    """The q-quantile (0-1) as Prometheus's histogram_quantile estimates it;
    nan for an empty histogram. In the +Inf bucket: the highest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            if n == prev_n:
                return le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


@dataclass
class LeaderShare:
    """A step's leader-side figures, milliseconds (nan: nothing observed)."""

    orders: int = 0
    residence_p50_ms: float = math.nan
    residence_p99_ms: float = math.nan
    lag_samples: int = 0
    lag_p50_ms: float = math.nan
    lag_p99_ms: float = math.nan


def leader_share(before: dict[str, Buckets], after: dict[str, Buckets]) -> LeaderShare:
    res = delta(before.get(RESIDENCE, []), after.get(RESIDENCE, []))
    lag = delta(before.get(LOOP_LAG, []), after.get(LOOP_LAG, []))
    return LeaderShare(
        orders=int(res[-1][1]) if res else 0,
        residence_p50_ms=quantile(res, 0.50) * 1000,
        residence_p99_ms=quantile(res, 0.99) * 1000,
        lag_samples=int(lag[-1][1]) if lag else 0,
        lag_p50_ms=quantile(lag, 0.50) * 1000,
        lag_p99_ms=quantile(lag, 0.99) * 1000,
    )
