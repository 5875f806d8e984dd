"""The connector's counters through vLLM's connector stats API
(vllm_integration/stats.py): each rank's step stats, summed over the ranks as
vLLM's engine core sums them, added to counters as vLLM's API server does,
in a registry of the test's own. A real engine's /metrics is checked in
tests/test_e2e_vllm.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pushkv.agent.events import EventKind
from pushkv.vllm_integration.connector import PushKVConnector
from pushkv.vllm_integration.metrics import ConnectorCounts, StepStats
from pushkv.vllm_integration.stats import PushKVStats, rank_stats
from tests.support.waits import wait_until

NO_SUCH_PID = 2**22 + 7  # read_schedstat finds nothing: only the counts move
OPERATIONS_DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
LABELNAMES = ["model_name", "engine"]  # what vLLM's PrometheusStatLogger passes


def test_a_step_hands_back_only_what_changed_since_the_last() -> None:
    counts = ConnectorCounts()
    step = StepStats(counts, pid=NO_SUCH_PID)
    assert step.take() is None
    counts.ready += 2
    counts.events[EventKind.KV_READY] += 2
    counts.fallbacks["transfer_failed"] += 1
    assert step.take() == {"ready": 2, "event:kv_ready": 2, "fallback:transfer_failed": 1}
    assert step.take() is None
    counts.freed += 1
    assert step.take() == {"freed": 1}


def test_the_forward_threads_schedstat_moves_with_the_kernels() -> None:
    """A real process that keeps a CPU busy stands for the forward thread."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        step = StepStats(ConnectorCounts(), pid=child.pid)
        run_ns = 0

        def ran() -> bool:
            nonlocal run_ns
            run_ns += (step.take() or {}).get("run_ns", 0)
            return run_ns > 50_000_000

        # Read at most every SCHEDSTAT_EVERY_S, each reading the growth since the last.
        wait_until(ran, "the child's run time passes 50 ms through the step stats")
    finally:
        child.kill()
        child.wait(10)


class Registry:
    """vLLM's metric classes bound to a registry of the test's own."""

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()

        class C(Counter):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "registry": reg})

        class G(Gauge):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "registry": reg})

        class H(Histogram):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "registry": reg})

        self.types: dict[type, type] = {Counter: C, Gauge: G, Histogram: H}

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def documented() -> dict[str, frozenset[str]]:
    """The connector's rows of docs/operations.md's metric table: name -> labels."""
    out: dict[str, frozenset[str]] = {}
    for line in OPERATIONS_DOC.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and re.fullmatch(r"`pushkv_connector_\w+`", cells[0]):
            labels = frozenset(re.sub(r"\W.*", "", c.strip()) for c in cells[2].split(","))
            out[cells[0].strip("`")] = labels - {""}
    return out


def test_every_ranks_counts_reach_the_api_servers_counters() -> None:
    ranks = []
    for rank in (0, 1):
        counts = ConnectorCounts()
        counts.ready += 1 + rank
        counts.events[EventKind.KV_READY] += 1 + rank
        ranks.append(StepStats(counts, pid=NO_SUCH_PID).take())
    # One step: vLLM's engine core sums the ranks' answers, the first as the accumulator.
    first, second = (rank_stats("decode-0", r, c) for r, c in enumerate(ranks))
    assert first is not None and second is not None
    step1 = first.aggregate(second)
    # The next step: rank 1 failed a transfer; rank 0 counted nothing (None).
    counts = ConnectorCounts()
    counts.failed += 1
    counts.load_error_blocks += 3
    counts.fallbacks["transfer_failed"] += 1
    counts.freed += 1  # (a decode rank frees nothing: every counter gets a sample here)
    taken = StepStats(counts, pid=NO_SUCH_PID).take()
    assert taken is not None and rank_stats("decode-0", 0, None) is None
    # The forward thread's schedstat, as read in a step (ns).
    step2 = rank_stats("decode-0", 1, {**taken, "run_ns": 2_500_000_000, "wait_ns": 250_000_000})
    assert step2 is not None

    # The API server: data as vLLM carries it there, added to the counters.
    reg = Registry()
    engine = SimpleNamespace(kv_transfer_config=None)
    prom = PushKVConnector.build_prom_metrics(engine, reg.types, LABELNAMES, {0: ["tiny", "0"]})
    for stats in (step1, step2):
        data = PushKVConnector.build_kv_connector_stats(stats.to_dict()).to_dict()
        prom.observe(data, engine_idx=0)
    lbl = {"model_name": "tiny", "engine": "0", "engine_id": "decode-0"}
    ready = "pushkv_connector_transfers_ready_total"
    assert [reg.value(ready, **lbl, rank=r) for r in ("0", "1")] == [1, 2]
    events = "pushkv_connector_agent_events_total"
    assert reg.value(events, **lbl, rank="1", kind="kv_ready") == 2
    assert reg.value("pushkv_connector_transfers_failed_total", **lbl, rank="1") == 1
    assert reg.value("pushkv_connector_load_error_blocks_total", **lbl, rank="1") == 3
    fallbacks = "pushkv_connector_fallbacks_total"
    assert reg.value(fallbacks, **lbl, rank="1", reason="transfer_failed") == 1
    assert reg.value("pushkv_connector_transfers_failed_total", **lbl, rank="0") is None
    run = reg.value("pushkv_connector_forward_thread_run_seconds_total", **lbl, rank="1")
    wait = reg.value("pushkv_connector_forward_thread_wait_seconds_total", **lbl, rank="1")
    assert (run, wait) == (2.5, 0.25)
    # Every counter of the docs' table, with its labels (vLLM's too).
    scraped: dict[str, frozenset[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(reg.registry).decode()):
        if fam.name.startswith("pushkv_connector_") and fam.type == "counter":
            labels = frozenset(k for s in fam.samples for k in s.labels)
            scraped[fam.name + "_total"] = labels
    want = documented()
    assert set(want) == set(scraped)
    for name, labels in scraped.items():
        assert labels == want[name] | set(LABELNAMES), name


def test_stats_over_steps_add_up_for_vllms_log_line() -> None:
    """vLLM's periodic "KV Transfer metrics" log line sums the steps' stats
    (reduce); empty stats count for nothing."""
    acc = PushKVConnector.build_kv_connector_stats()
    assert acc.is_empty()
    for n in (1, 2):
        acc = acc.aggregate(PushKVStats(data={"engine_id": "p", "ranks": {"0": {"freed": n}}}))
    acc = acc.aggregate(PushKVStats(data={"engine_id": "p", "ranks": {"1": {"run_ns": 5}}}))
    assert not acc.is_empty()
    assert acc.reduce() == {"freed": 3}
