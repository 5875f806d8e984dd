"""The fault scenario of `pushkv bench serving --kill-prefill-at S`: kill -9 the
prefill engine S seconds into a rate's Poisson load, and report what the
clients saw: the success rate, and the TTFT of the requests served by
fallback (the decode engine computing the KV itself) against the requests
pushed before the kill.

A request is "pushed" if its first token came before the kill, and "after the
kill" otherwise (in flight at the kill, or sent after it: the router's and the
engines' fallback counters say how many of those went through fallback).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pushkv.bench.serving.deployment import Deployment
from pushkv.bench.serving.workload import ReqRecord
from pushkv.bench.stats import percentile
from pushkv.harness.vllm_server import metric_value
from pushkv.router.metrics import FALLBACK_REASONS


@dataclass
class PrefillKiller:
    """Kills the deployment's prefill engine `at_s` after `start()`."""

    dep: Deployment
    at_s: float
    killed_at: float | None = None  # seconds after start
    _timer: threading.Timer | None = field(default=None, repr=False)
    _t0: float = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._timer = threading.Timer(self.at_s, self._kill)
        self._timer.daemon = True
        self._timer.start()

    def _kill(self) -> None:
        for server in self.dep.servers:
            if "prefill" in server.name and server.proc is not None:
                os.killpg(server.proc.pid, signal.SIGKILL)
                self.killed_at = time.monotonic() - self._t0

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def router_fallbacks(front_url: str) -> dict[str, float]:
    """The router's pushkv_router_fallbacks_total, by reason."""
    with urllib.request.urlopen(front_url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        reason: metric_value(text, "pushkv_router_fallbacks_total", f'reason="{reason}"')
        for reason in FALLBACK_REASONS
    }


def fault_summary(
    recs: Sequence[ReqRecord], killed_at: float | None, fallbacks: dict[str, float]
) -> dict[str, Any]:
    """What the clients saw around the kill (times in seconds after the load's start)."""
    kill = killed_at if killed_at is not None else float("inf")
    pushed = [r for r in recs if r.ok and r.first is not None and r.first < kill]
    after = [r for r in recs if not (r.ok and r.first is not None and r.first < kill)]

    def ttft_ms(rs: Sequence[ReqRecord]) -> dict[str, float]:
        values = [r.ttft * 1000 for r in rs if r.ok and r.ttft is not None]
        return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}

    ok = sum(1 for r in recs if r.ok)
    return {
        "killed_at_s": killed_at,
        "requests": len(recs),
        "ok": ok,
        "success_rate": ok / len(recs) if recs else float("nan"),
        "errors": sorted({r.error or "timed out" for r in recs if not r.ok})[:5],
        "ttft_pushed_ms": ttft_ms(pushed),
        "ttft_after_kill_ms": ttft_ms(after),
        "router_fallbacks": fallbacks,
    }


def fault_lines(f: dict[str, Any]) -> list[str]:
    p, a = f["ttft_pushed_ms"], f["ttft_after_kill_ms"]
    ratio = a["p50"] / p["p50"] if p["n"] and a["n"] and p["p50"] > 0 else float("nan")
    killed = f["killed_at_s"]
    return [
        f"    fault: prefill engine killed at {killed:.1f} s"
        if killed is not None
        else "    fault: the prefill engine was not killed (the load ended first)",
        f"    fault: {f['ok']}/{f['requests']} ok (success rate {f['success_rate']:.3f})"
        + (f"; errors: {f['errors']}" if f["errors"] else ""),
        f"    fault: TTFT pushed p50 {p['p50']:.0f} ms p99 {p['p99']:.0f} ms (n={p['n']}); "
        f"after the kill p50 {a['p50']:.0f} ms p99 {a['p99']:.0f} ms (n={a['n']}); "
        f"after/pushed p50 ratio {ratio:.2f}",
        f"    fault: router fallbacks by reason: {f['router_fallbacks']}",
    ]
