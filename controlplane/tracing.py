"""OpenTelemetry spans of the coordinator: one per transfer (PUSHKV_OTEL=1).

A `TransferObserver` (controlplane/timeline.py), like the Prometheus metrics
(controlplane/metrics.py): the runtime calls `on_transfer_changed(t)` on the
event loop after it applied a change, and the tracer reads the transfer's new
timeline events. Opentelemetry is an optional dependency, imported only when
tracing is on and used through `Any`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import TYPE_CHECKING, Any

import structlog

from pushkv.controlplane.domain import State
from pushkv.controlplane.timeline import TERMINAL_STAGES, TimelineCursor
from pushkv.controlplane.transfer import Transfer

if TYPE_CHECKING:
    from pushkv.controlplane.runtime import Runtime

log = structlog.get_logger("pushkv.coordinator")

OTEL_ENV = "PUSHKV_OTEL"
OTEL_EXPORTER_ENV = "PUSHKV_OTEL_EXPORTER"


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


class TransferTracer:
    """One OpenTelemetry span per transfer (name "pushkv.transfer"), one event per stage.

    The span starts at the transfer's creation, carries the transfer id and
    engines as attributes, and ends at the terminal state (events recorded
    after that, such as "released", are not traced). Opentelemetry is an
    optional dependency, used through `Any`.
    """

    def __init__(self, runtime: Runtime, tracer_provider: Any) -> None:
        self._rt = runtime
        self._tracer = tracer_provider.get_tracer("pushkv.coordinator")
        self._spans: dict[str, Any] = {}
        self._cursor = TimelineCursor(self._alive)
        self._status = importlib.import_module("opentelemetry.trace").Status
        self._status_code = importlib.import_module("opentelemetry.trace").StatusCode

    def _alive(self, transfer_id: str) -> bool:
        return self._rt.core.has_transfer(transfer_id)

    def on_transfer_changed(self, t: Transfer) -> None:
        fresh, events = self._cursor.new_events(t)
        span = self._spans.get(t.transfer_id)
        if fresh:
            if span is not None:  # the id was reused before the old one ended
                span.end()
            span = self._tracer.start_span(
                "pushkv.transfer",
                start_time=_ns(t.created_wall),
                attributes={"pushkv.transfer_id": t.transfer_id},
            )
            self._spans[t.transfer_id] = span
        if span is None:
            return  # already ended
        for stage, at, rank in events:
            attrs = {"pushkv.rank": rank} if rank >= 0 else {}
            span.add_event(stage, attributes=attrs, timestamp=_ns(at))
            if stage in TERMINAL_STAGES:
                span.set_attribute("pushkv.prefill_engine", t.prefill_engine or "")
                span.set_attribute("pushkv.decode_engine", t.decode_engine or "")
                span.set_attribute("pushkv.state", t.state.value)
                span.set_attribute("pushkv.reason", t.reason.value)
                if t.state is not State.COMPLETE:
                    span.set_status(self._status(self._status_code.ERROR, t.detail))
                span.end(end_time=_ns(at))
                del self._spans[t.transfer_id]
                return

    def close(self) -> None:
        for span in self._spans.values():
            with contextlib.suppress(Exception):
                span.end()
        self._spans.clear()


def tracer_from_env(runtime: Runtime) -> TransferTracer | None:
    """A tracer when PUSHKV_OTEL=1 and opentelemetry is importable, else None.

    If no SDK tracer provider is configured yet (for example by
    `opentelemetry-instrument`), one is installed that exports with OTLP
    (standard OTEL_EXPORTER_OTLP_* variables) or, with
    PUSHKV_OTEL_EXPORTER=console, prints spans to stdout, one JSON object a
    line.
    """
    if os.environ.get(OTEL_ENV, "").lower() not in ("1", "true", "yes", "on"):
        return None
    try:
        trace = importlib.import_module("opentelemetry.trace")
    except ImportError:
        log.warning("otel_unavailable", detail="PUSHKV_OTEL=1 but opentelemetry is not installed")
        return None
    provider = trace.get_tracer_provider()
    if type(provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
        try:
            provider = _sdk_provider()
        except ImportError as exc:
            log.warning("otel_sdk_unavailable", error=str(exc))
            return None
        trace.set_tracer_provider(provider)
    log.info("otel_enabled", provider=type(provider).__name__)
    return TransferTracer(runtime, provider)


def _sdk_provider() -> Any:
    sdk = importlib.import_module("opentelemetry.sdk.trace")
    export = importlib.import_module("opentelemetry.sdk.trace.export")
    resources = importlib.import_module("opentelemetry.sdk.resources")
    provider = sdk.TracerProvider(
        resource=resources.Resource.create({"service.name": "pushkv-coordinator"})
    )
    if os.environ.get(OTEL_EXPORTER_ENV, "otlp") == "console":
        exporter = export.ConsoleSpanExporter(
            formatter=lambda span: span.to_json(indent=None) + os.linesep
        )
    else:
        otlp = importlib.import_module("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
        exporter = otlp.OTLPSpanExporter()
    provider.add_span_processor(export.BatchSpanProcessor(exporter))
    return provider
