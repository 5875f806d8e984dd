"""Prometheus metrics of the router, served on its own `GET /metrics`.

The object owns its registry: several routers may share a test process.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OUTCOMES = ("ok", "client_error", "unavailable", "engine_error", "aborted")
FALLBACK_REASONS = (
    "prefill_failed",
    "coordinator_unavailable",
    "no_prefill_engine",
    "no_compatible_prefill",
    "decode_unlisted",
)


def outcome_of(status: int) -> str:
    """Bounded request outcome of an HTTP status the router answered."""
    if status < 400:
        return "ok"
    if status in (429, 503):
        return "unavailable"
    return "client_error" if status < 500 else "engine_error"


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pushkv_router_ttft_seconds",
            "time from receiving a request to the first response bytes of its decode leg",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pushkv_router_requests",
            "completion requests by outcome (ok, client_error, unavailable, engine_error, aborted)",
            ["outcome"],
            registry=r,
        )
        self.inflight = Gauge(
            "pushkv_router_inflight_requests", "completion requests being served", registry=r
        )
        self.leg_retries = Counter(
            "pushkv_router_leg_retries",
            "legs re-sent because the engine closed the connection before any answer",
            ["leg"],
            registry=r,
        )
        for leg in ("prefill", "decode"):
            self.leg_retries.labels(leg)
        self.fallbacks = Counter(
            "pushkv_router_fallbacks",
            "requests the decode engine served without a push, by reason "
            "(prefill_failed, coordinator_unavailable, no_prefill_engine, no_compatible_prefill, "
            "decode_unlisted)",
            ["reason"],
            registry=r,
        )
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)
        for o in OUTCOMES:
            self.requests.labels(o)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
