"""Which build of the coordinator's core this process runs.

The core (``CORE_MODULES``: typed, no gRPC, what a rendezvous runs) is plain
Python. A wheel built with ``PUSHKV_MYPYC=1`` (setup.py) also holds each of
these modules compiled by mypyc; Python's import system then loads the
extension module ahead of the ``.py`` beside it. An editable install never
compiles, so an edited source always runs as itself.
"""

from __future__ import annotations

from pathlib import Path

CORE_MODULES = (
    "domain",
    "errors",
    "settings",
    "validation",
    "transfer",
    "transfer_filter",
    "registry",
    "timeline",
    "metric_families",
    "transfer_metrics",
    "admission",
    "order_size",
    "orders",
    "adoption",
    "resubmission",
    "expiry",
    "notices",
    "inflight",
    "agent_loss",
    "rendezvous",
    "convert",
    "runtime",
    "calls",
    "auth",
)


def core_build() -> str:
    """ "compiled" when the core's modules were loaded from mypyc extensions, else "python"."""
    from pushkv.controlplane import rendezvous

    return "python" if Path(rendezvous.__file__ or "").suffix == ".py" else "compiled"
