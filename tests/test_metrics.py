"""Prometheus metrics of the coordinator and the router, scraped over HTTP.

Transfers run through a real coordinator with simulated agents
(tests/support/sim_agent.py); every wait is on a stream, an ack or a deadline.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

from pushkv.cli.main import build_parser
from pushkv.controlplane import tracing
from pushkv.controlplane import transfer_metrics as cmetrics
from pushkv.controlplane.core_build import core_build
from pushkv.controlplane.metric_families import CounterFamily, HistogramFamily, created_series
from pushkv.controlplane.server import Coordinator, ServerSettings, start
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.vllm_server import free_port
from pushkv.relay.server import Relay, RelaySettings
from pushkv.router.app import Router, RouterSettings
from pushkv.router.metrics import outcome_of
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimAgent, SimCluster, blocks, rendezvous, wait_terminal

WAIT = 10.0
OPERATIONS_DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
BLOCK_BYTES = 3 * 2 * 4096  # 3 blocks x (K and V regions) x 4096 bytes

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, (
        f"{name}{labels} not scraped; have {sorted(k for k in samples if k[0] == name)}"
    )
    return samples[key]


async def scrape(url: str) -> tuple[str, Samples]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url, timeout=aiohttp.ClientTimeout(WAIT)) as r,
    ):
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return text, parse(text)


Families = dict[str, tuple[str, frozenset[str]]]  # name -> (type, label names)


def documented_coordinator_metrics() -> Families:
    """The coordinator's rows of the metric table in docs/operations.md."""
    out: Families = {}
    for line in OPERATIONS_DOC.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 4 or not re.fullmatch(r"`pushkv_\w+`", cells[0]):
            continue
        name = cells[0].strip("`")
        if name.startswith(("pushkv_router_", "pushkv_connector_")):
            continue
        # "side=`decode_first`\|...", "engine (prefill)": the name leads each label.
        labels = frozenset(re.sub(r"\W.*", "", c.strip()) for c in cells[2].split(",")) - {""}
        kind = "gauge" if cells[1] == "info" else cells[1]  # the text format's info is a gauge
        out[name] = (kind, labels)
    return out


def scraped_families(text: str) -> Families:
    """name -> (type, label names) of the pushkv_ families of a scrape, as the docs name them."""
    out: Families = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("pushkv_") or fam.name.endswith("_created"):
            continue
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name] = (fam.type, frozenset(k for smp in fam.samples for k in smp.labels) - {"le"})
    return out


@pytest.fixture
async def coord() -> AsyncIterator[Coordinator]:
    c = await start(ServerSettings(port=0, metrics_port=0))
    yield c
    await c.stop(0)


@pytest.fixture
async def cluster(coord: Coordinator) -> AsyncIterator[SimCluster]:
    async with SimCluster(coord.address, auto_complete=False) as c:
        yield c


def dec_req(tid: str) -> pb.RegisterDecodeBlocksRequest:
    return pb.RegisterDecodeBlocksRequest(
        transfer_id=tid, decode_engine_id="d0", block_ids=blocks([7, 8, 9]), num_tokens=40
    )


def pre_req(tid: str) -> pb.ReportPrefillDoneRequest:
    return pb.ReportPrefillDoneRequest(
        transfer_id=tid, prefill_engine_id="p0", block_ids=blocks([1, 2, 3]), num_tokens=40
    )


async def write(p: SimAgent, order: pb.TransferOrder, status: int, **kw: Any) -> None:
    await p.send(
        pb.AgentMessage(
            write=pb.WriteReport(
                order_id=order.order_id,
                transfer_id=order.transfer_id,
                status=status,  # type: ignore[arg-type]
                **kw,
            )
        )
    )


async def complete(
    ch: grpc.aio.Channel, cl: SimCluster, tid: str, *, decode_first: bool
) -> pb.TransferStatus:
    """One transfer through every stage, reported with bytes and descriptors."""
    stub = pbg.TransferServiceStub(ch)
    p, d = cl.prefill[0], cl.decode[0]
    if decode_first:
        await stub.RegisterDecodeBlocks(dec_req(tid))
        await stub.ReportPrefillDone(pre_req(tid))
    else:
        await stub.ReportPrefillDone(pre_req(tid))
        await stub.RegisterDecodeBlocks(dec_req(tid))
    order = await p.expect("order", WAIT, skip=("peer", "notice"))
    assert order.transfer_id == tid
    await write(p, order, pb.WRITE_STATUS_POSTED)
    await write(p, order, pb.WRITE_STATUS_DONE, bytes=BLOCK_BYTES, descriptors=6)
    await d.report_arrival(tid, [0])
    await asyncio.gather(p.heartbeat(), d.heartbeat())  # the reports were applied
    status: pb.TransferStatus = await pbg.StatusServiceStub(ch).GetTransfer(
        pb.GetTransferRequest(transfer_id=tid)
    )
    assert status.state == pb.TRANSFER_STATE_COMPLETE, status
    return status


async def test_coordinator_metrics_after_real_transfers(
    coord: Coordinator, cluster: SimCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert coord.metrics_port and coord.metrics is not None
    # The observer's plain counters take no lock: it must only run on the loop's thread.
    threads: set[int] = set()
    events = coord.metrics.events

    class OnLoop:
        def on_transfer_changed(self, t: Any) -> None:
            threads.add(threading.get_ident())
            events.on_transfer_changed(t)

    observers = [OnLoop() if o is events else o for o in coord.runtime.observers]
    monkeypatch.setattr(coord.runtime, "observers", observers)
    async with grpc.aio.insecure_channel(coord.address) as ch:
        stub = pbg.TransferServiceStub(ch)
        await complete(ch, cluster, "m-decode-first", decode_first=True)
        await complete(ch, cluster, "m-prefill-first", decode_first=False)
        await stub.ReportPrefillDone(pre_req("m-cancelled"))
        await stub.Cancel(pb.CancelRequest(transfer_id="m-cancelled", reason="test"))
        await stub.RegisterDecodeBlocks(dec_req("m-waiting"))

        text, s = await scrape(f"http://127.0.0.1:{coord.metrics_port}/metrics")

    assert threads == {threading.get_ident()}
    assert value(s, "pushkv_transfers_started_total") == 4
    assert value(s, "pushkv_transfers_finished_total", state="complete", reason="none") == 2
    assert value(s, "pushkv_transfers_finished_total", state="cancelled", reason="cancelled") == 1
    assert value(s, "pushkv_transfers_inflight", state="registered") == 1
    for st in ("awaiting", "prefill_done", "ordered", "writing"):
        assert value(s, "pushkv_transfers_inflight", state=st) == 0

    for side in ("decode_first", "prefill_first"):
        assert value(s, "pushkv_rendezvous_wait_seconds_count", side=side) == 1
        assert 0 <= value(s, "pushkv_rendezvous_wait_seconds_sum", side=side) < WAIT
    assert value(s, "pushkv_order_latency_seconds_count") == 2
    assert 0 <= value(s, "pushkv_order_latency_seconds_sum") < 1.0
    for name in (
        "pushkv_write_post_seconds",
        "pushkv_write_completion_seconds",
        "pushkv_transfer_write_seconds",
    ):
        assert value(s, f"{name}_count") == 2, name
        assert 0 <= value(s, f"{name}_sum") < WAIT, name
        # Cumulative buckets end with +Inf == count.
        assert value(s, f"{name}_bucket", le="+Inf") == 2
    assert value(s, "pushkv_transfer_duration_seconds_count", state="complete") == 2
    assert value(s, "pushkv_transfer_duration_seconds_count", state="cancelled") == 1

    assert value(s, "pushkv_write_reports_total", status="posted") == 2
    assert value(s, "pushkv_write_reports_total", status="done") == 2
    assert value(s, "pushkv_write_bytes_total", engine="p0") == 2 * BLOCK_BYTES
    assert value(s, "pushkv_write_descriptors_total", engine="p0") == 12
    assert value(s, "pushkv_write_size_bytes_count") == 2
    assert value(s, "pushkv_write_size_bytes_sum") == 2 * BLOCK_BYTES
    # Cumulative buckets: both 24 KiB WRITEs fall in (16 KiB, 64 KiB].
    size = {dict(k[1])["le"]: v for k, v in s.items() if k[0] == "pushkv_write_size_bytes_bucket"}
    # `le` as prometheus_client writes it (Go's float format: exponents from 1e+06).
    assert list(size) == [
        *("4096.0", "16384.0", "65536.0", "262144.0", "1.048576e+06", "4.194304e+06"),
        *("1.6777216e+07", "6.7108864e+07", "2.68435456e+08", "1.073741824e+09"),
        *("4.294967296e+09", "+Inf"),
    ]
    assert (size["4096.0"], size["16384.0"], size["65536.0"], size["+Inf"]) == (0, 0, 2, 2)
    # One residence per order sent (one order per completed transfer at TP 1),
    # each no longer than the test took.
    assert value(s, "pushkv_order_residence_seconds_count") == 2
    assert 0 <= value(s, "pushkv_order_residence_seconds_sum") < WAIT
    for side in ("decode_first", "prefill_first"):
        wait = [
            v
            for k, v in s.items()
            if k[0] == "pushkv_rendezvous_wait_seconds_bucket" and ("side", side) in k[1]
        ]
        assert len(wait) == len(cmetrics.WAIT_BUCKETS) + 1
        assert wait == sorted(wait) and wait[-1] == 1
    # prometheus_client's *_created series, per label set (docs/operations.md).
    for name, labels in (
        ("pushkv_transfers_started_created", {}),
        ("pushkv_transfers_finished_created", {"state": "complete", "reason": "none"}),
        ("pushkv_write_bytes_created", {"engine": "p0"}),
        ("pushkv_write_size_bytes_created", {}),
        ("pushkv_rendezvous_wait_seconds_created", {"side": "decode_first"}),
        ("pushkv_transfer_duration_seconds_created", {"state": "cancelled"}),
    ):
        assert value(s, name, **labels) > 1e9, name

    for engine, role in (("p0", "prefill"), ("d0", "decode")):
        assert value(s, "pushkv_engine_ready", engine=engine, role=role) == 1
        assert value(s, "pushkv_agents_connected", engine=engine, role=role) == 1
        assert value(s, "pushkv_agents_registered", engine=engine, role=role) == 1
        assert 0 <= value(s, "pushkv_agent_last_seen_seconds", engine=engine, rank="0") < WAIT
        lease = value(s, "pushkv_agent_lease_remaining_seconds", engine=engine, rank="0")
        assert 0 < lease <= 5.0  # CoreSettings.lease_s
        assert value(s, "pushkv_agent_open_orders", engine=engine, rank="0") == 0
        # The per-engine aggregates of the same scrape (one rank: its values).
        assert value(s, "pushkv_engine_open_orders", engine=engine, role=role) == 0
        seen_max = value(s, "pushkv_engine_agent_last_seen_max_seconds", engine=engine, role=role)
        assert seen_max == value(s, "pushkv_agent_last_seen_seconds", engine=engine, rank="0")
        left_min = "pushkv_engine_agent_lease_remaining_min_seconds"
        assert value(s, left_min, engine=engine, role=role) == lease
    assert value(s, "pushkv_engine_inflight_transfers", engine="d0", role="decode") == 1
    assert value(s, "pushkv_engine_inflight_transfers", engine="p0", role="prefill") == 0
    info = [k for k in s if k[0] == "pushkv_coordinator_info"]
    assert dict(info[0][1])["coordinator_id"] == coord.runtime.core.coordinator_id
    assert dict(info[0][1])["core"] == core_build()

    # docs/operations.md's table lists every coordinator metric, with its type and labels.
    assert scraped_families(text) == documented_coordinator_metrics()

    # Every metric of ours is pushkv_-prefixed, and no label carries a transfer id.
    ours = [k for k in s if not k[0].startswith(("python_", "process_"))]
    assert all(name.startswith("pushkv_") for name, _ in ours)
    assert "m-decode-first" not in text and "transfer_id" not in text


class _Families:
    """A registry collector for some plain families, as CoordinatorMetrics exports them."""

    def __init__(self, *families: Any) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        created = created_series()
        return [f.export(f.copy(), created) for f in self.families]


def without_created(text: bytes) -> str:
    return re.sub(r"(?m)^(\S+_created(?:\{.*\})?) \S+$", r"\1 T", text.decode())


def test_plain_families_export_as_prometheus_client() -> None:
    """Same observations: the same exposition as prometheus_client's own metrics."""
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    hist = Histogram("x_seconds", "doc h", ["side"], buckets=(0.001, 0.5, 2.0), registry=theirs)
    plain = Histogram("y_bytes", "doc y", buckets=cmetrics.BYTE_BUCKETS, registry=theirs)
    count = Counter("x_events", "doc c", ["state", "reason"], registry=theirs)
    hist.labels("decode_first")  # pre-created, never observed
    my_hist = HistogramFamily("x_seconds", "doc h", (0.001, 0.5, 2.0), ("side",))
    my_plain = HistogramFamily("y_bytes", "doc y", cmetrics.BYTE_BUCKETS)
    my_count = CounterFamily("x_events", "doc c", ("state", "reason"))
    my_hist.child("decode_first")
    ours.register(_Families(my_hist, my_plain, my_count))
    # Bounds exactly, between, below the first, above the last, ints.
    for i, v in enumerate((0.0, 0.001, 0.0011, 0.5, 2.0, 2.5, 1e9, -1.0, 3, 0.25)):
        side = ("decode_first", "prefill_first")[i % 2]
        hist.labels(side).observe(v)
        my_hist.child(side).observe(v)
        plain.observe(v * 1e6)
        my_plain.child().observe(v * 1e6)
        count.labels("complete" if i % 3 else "failed", "none").inc(i)
        my_count.child("complete" if i % 3 else "failed", "none").value += i
    mine = generate_latest(ours)
    assert without_created(mine) == without_created(generate_latest(theirs))
    created = [ln for ln in mine.splitlines() if b"_created" in ln and not ln.startswith(b"#")]
    assert len(created) == 2 + 1 + 2  # one per series
    assert b'x_seconds_bucket{le="+Inf",side="prefill_first"} 5.0' in mine
    # prometheus_client's switch for *_created series holds for ours as well.
    was_on = created_series()
    disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated in prometheus_client
    try:
        assert generate_latest(ours) == generate_latest(theirs)
        assert b"_created" not in generate_latest(ours)
    finally:
        if was_on:
            enable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated in prometheus_client


def test_scrape_copies_while_the_loop_adds_series() -> None:
    """A scrape thread copying while the loop thread adds series never fails."""
    fam = HistogramFamily("z_seconds", "doc", cmetrics.WAIT_BUCKETS, ("engine",))
    stop = threading.Event()
    errors: list[BaseException] = []

    def scraper() -> None:
        while not stop.is_set():
            try:
                fam.export(fam.copy(), True)
            except BaseException as exc:  # pragma: no cover - the failure reported below
                errors.append(exc)
                return

    th = threading.Thread(target=scraper)
    th.start()
    try:
        for i in range(20_000):
            fam.child(f"e{i}").observe(i * 1e-4)
    finally:
        stop.set()
        th.join()
    assert not errors, errors
    assert len(fam.copy()) == 20_000


async def test_failures_are_counted_by_reason(coord: Coordinator, cluster: SimCluster) -> None:
    async with grpc.aio.insecure_channel(coord.address) as ch:
        stub = pbg.TransferServiceStub(ch)
        p = cluster.prefill[0]
        await stub.RegisterDecodeBlocks(dec_req("m-fail"))
        await stub.ReportPrefillDone(pre_req("m-fail"))
        order = await p.expect("order", WAIT, skip=("peer", "notice"))
        await write(p, order, pb.WRITE_STATUS_POSTED)
        await write(p, order, pb.WRITE_STATUS_FAILED, detail="NIXL_ERR_REMOTE_DISCONNECT")
        await p.heartbeat()
        _, s = await scrape(f"http://127.0.0.1:{coord.metrics_port}/metrics")
    assert value(s, "pushkv_transfers_finished_total", state="failed", reason="write_failed") == 1
    assert value(s, "pushkv_write_reports_total", status="failed") == 1
    assert value(s, "pushkv_transfers_inflight", state="writing") == 0
    assert value(s, "pushkv_transfer_write_seconds_count") == 0


async def test_lease_gauges_follow_agents(coord: Coordinator) -> None:
    url = f"http://127.0.0.1:{coord.metrics_port}/metrics"
    async with SimCluster(coord.address, tp_size=2, auto_complete=False) as cl:
        _, s = await scrape(url)
        assert value(s, "pushkv_agents_connected", engine="p0", role="prefill") == 2
        for rank in ("0", "1"):
            assert value(s, "pushkv_agent_last_seen_seconds", engine="d0", rank=rank) >= 0
        # Graceful: returns once the server ended the stream, i.e. after it
        # marked the rank disconnected.
        await cl.decode[1].close(graceful=True)
        _, s = await scrape(url)
        assert value(s, "pushkv_agents_connected", engine="d0", role="decode") == 1
        assert value(s, "pushkv_agents_registered", engine="d0", role="decode") == 2
        # The engine's aggregates: its most silent rank, its first lease to expire.
        seen = [value(s, "pushkv_agent_last_seen_seconds", engine="d0", rank=r) for r in "01"]
        left = [value(s, "pushkv_agent_lease_remaining_seconds", engine="d0", rank=r) for r in "01"]
        d0 = {"engine": "d0", "role": "decode"}
        assert value(s, "pushkv_engine_agent_last_seen_max_seconds", **d0) == max(seen)
        assert value(s, "pushkv_engine_agent_lease_remaining_min_seconds", **d0) == min(left)
        # Not ready once the rank's reconnect grace is over (within it the
        # engine stays ready: tests/test_rendezvous.py).
        deadline = time.monotonic() + 10.0
        while value(s, "pushkv_engine_ready", engine="d0", role="decode") != 0:
            assert time.monotonic() < deadline, "d0 still ready past the grace"
            await asyncio.sleep(0.05)  # polling the scrape under a deadline
            _, s = await scrape(url)
        assert value(s, "pushkv_agents_registered", engine="d0", role="decode") == 2


@pytest.mark.parametrize("path", ["agent_stream", "node_relay"])
async def test_every_order_sent_has_its_residence(coord: Coordinator, path: str) -> None:
    """One residence per order handed to gRPC, on an agent's own stream and
    on a node relay's stream (a queue hop later), none longer than the test."""
    relay = None
    if path == "node_relay":
        settings = RelaySettings(coordinators=coord.address, listen="127.0.0.1:0")
        relay = await Relay(settings).start()
    address = relay.address if relay is not None else coord.address
    url = f"http://127.0.0.1:{coord.metrics_port}/metrics"
    try:
        async with (
            SimCluster(address, tp_size=2, batching=True) as cl,
            grpc.aio.insecure_channel(coord.address) as ch,
        ):
            ids = [f"res-{i}" for i in range(6)]
            await asyncio.gather(
                *(rendezvous(ch, t, decode_first=i % 2 == 0) for i, t in enumerate(ids))
            )
            done = await wait_terminal(ch, ids, WAIT)
            assert {st.state for st in done.values()} == {pb.TRANSFER_STATE_COMPLETE}
            orders = sum(len(p.orders_seen) for p in cl.prefill)
            assert orders == 2 * len(ids)  # one per prefill rank
            _, s = await scrape(url)
    finally:
        if relay is not None:
            await relay.stop()
    assert value(s, "pushkv_order_residence_seconds_count") == orders
    assert value(s, "pushkv_order_residence_seconds_bucket", le="+Inf") == orders
    assert 0 < value(s, "pushkv_order_residence_seconds_sum") < WAIT


async def test_a_stalled_event_loop_shows_as_lag(coord: Coordinator) -> None:
    """The loop-lag sampler records how late its timer ran: a 60 ms stall of
    the coordinator's loop (the test runs on it) lands above 25 ms."""
    url = f"http://127.0.0.1:{coord.metrics_port}/metrics"

    def late() -> float:  # samples above 25 ms
        return value(s, "pushkv_event_loop_lag_seconds_count") - value(
            s, "pushkv_event_loop_lag_seconds_bucket", le="0.025"
        )

    _, s = await scrape(url)
    before = late()
    stall_until = time.monotonic() + 0.06
    while time.monotonic() < stall_until:  # the stall: no await, the loop is held
        pass
    deadline = time.monotonic() + WAIT
    while True:  # the late timer is recorded when the loop runs again
        _, s = await scrape(url)
        if late() > before:
            break
        assert time.monotonic() < deadline, "no lag sample above 25 ms"
        await asyncio.sleep(0.005)  # poll, under the deadline
    assert value(s, "pushkv_event_loop_lag_seconds_sum") >= 0.035


async def test_without_rank_series_the_engine_aggregates_stay() -> None:
    """--rank-metrics false: no pushkv_agent_* series (three per rank), the
    per-engine aggregates as before; an open order counts on its engine."""
    c = await start(ServerSettings(port=0, metrics_port=0, rank_metrics=False))
    try:
        async with SimCluster(c.address, tp_size=2, auto_complete=False) as cl:
            async with grpc.aio.insecure_channel(c.address) as ch:
                stub = pbg.TransferServiceStub(ch)
                await stub.RegisterDecodeBlocks(dec_req("m-agg"))
                await stub.ReportPrefillDone(pre_req("m-agg"))
            for p in cl.prefill:
                await p.expect("order", WAIT, skip=("peer", "notice"))
            text, s = await scrape(f"http://127.0.0.1:{c.metrics_port}/metrics")
    finally:
        await c.stop(0)
    assert value(s, "pushkv_engine_open_orders", engine="p0", role="prefill") == 2
    assert value(s, "pushkv_engine_open_orders", engine="d0", role="decode") == 0
    assert value(s, "pushkv_agents_connected", engine="p0", role="prefill") == 2
    left = value(s, "pushkv_engine_agent_lease_remaining_min_seconds", engine="p0", role="prefill")
    assert 0 < left <= 5.0
    per_rank = {"pushkv_agent_last_seen_seconds", "pushkv_agent_lease_remaining_seconds"}
    per_rank.add("pushkv_agent_open_orders")
    scraped = set(scraped_families(text))
    assert not [k for k in s if k[0].startswith("pushkv_agent_")]
    assert not scraped & per_rank
    assert scraped == set(documented_coordinator_metrics()) - per_rank
    flag = build_parser()[0].parse_args(["coordinator", "--rank-metrics", "false"])
    assert flag.rank_metrics is False


async def test_metrics_are_off_unless_asked() -> None:
    c = await start(ServerSettings(port=0))
    try:
        assert c.metrics is None and c.metrics_port is None
        # Only the outcome log line remains; no metrics or tracing observers.
        assert [type(o).__name__ for o in c.runtime.observers] == ["TransferLog"]
    finally:
        await c.stop(0)


async def test_tracing_one_span_per_transfer(
    coord: Coordinator, cluster: SimCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    sdk = importlib.import_module("opentelemetry.sdk.trace")
    export = importlib.import_module("opentelemetry.sdk.trace.export")
    memory = importlib.import_module("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    exporter = memory.InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(exporter))
    tracer = tracing.TransferTracer(coord.runtime, provider)
    coord.runtime.observers.append(tracer)

    monkeypatch.delenv("PUSHKV_OTEL", raising=False)
    assert tracing.tracer_from_env(coord.runtime) is None  # off unless PUSHKV_OTEL=1

    async with grpc.aio.insecure_channel(coord.address) as ch:
        await complete(ch, cluster, "m-traced", decode_first=True)
    [span] = exporter.get_finished_spans()
    assert span.name == "pushkv.transfer"
    assert span.attributes["pushkv.transfer_id"] == "m-traced"
    assert span.attributes["pushkv.state"] == "complete"
    stages = [e.name for e in span.events]
    assert stages[:3] == ["decode_registered", "prefill_done", "ordered"]
    assert {"write_posted", "write_done", "arrived"} <= set(stages)
    assert stages[-1] == "complete"
    assert span.start_time <= span.events[0].timestamp <= span.end_time


# ---------------------------------------------------------------- CLI flag


@pytest.fixture
def coord_process() -> Iterator[tuple[CoordinatorProcess, int]]:
    port = free_port()
    c = CoordinatorProcess("--log-level", "WARNING", "--metrics-port", str(port)).start()
    yield c, port
    c.stop()


async def test_pushkv_coordinator_metrics_port_flag(
    coord_process: tuple[CoordinatorProcess, int],
) -> None:
    c, port = coord_process
    async with SimCluster(c.address, auto_complete=True) as cl:
        async with grpc.aio.insecure_channel(c.address) as ch:
            watch = pbg.StatusServiceStub(ch).WatchTransfers(
                pb.WatchTransfersRequest(states=[pb.TRANSFER_STATE_COMPLETE]), timeout=WAIT
            )
            stub = pbg.TransferServiceStub(ch)
            await stub.RegisterDecodeBlocks(dec_req("m-cli"))
            await stub.ReportPrefillDone(pre_req("m-cli"))
            event = await watch.read()
            watch.cancel()
            assert isinstance(event, pb.TransferEvent) and event.transfer.transfer_id == "m-cli"
        _, s = await scrape(f"http://127.0.0.1:{port}/metrics")
        assert value(s, "pushkv_transfers_finished_total", state="complete", reason="none") == 1
        assert value(s, "pushkv_agents_connected", engine="p0", role="prefill") == 1
        assert cl.prefill[0].orders_seen


# ---------------------------------------------------------------- router


async def test_router_metrics_route(coord: Coordinator) -> None:
    async def prefill(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "x"}]})

    async def decode(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "decoded"}]})

    runners: list[web.AppRunner] = []
    agents: list[SimAgent] = []
    try:
        for role, handler in (("prefill", prefill), ("decode", decode)):
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            host, port = runner.addresses[0][:2]
            agent = SimAgent(coord.address, f"{role}-0", role)
            agent.hello.hello.api_url = f"http://{host}:{port}"
            await agent.start()
            agents.append(agent)
        router = Router(RouterSettings(coordinator=coord.address, port=0))
        runner = web.AppRunner(router.app())
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        base = f"http://{host}:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base}/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 200
            async with http.post(f"{base}/v1/completions", json={"prompt": ""}) as r:
                assert r.status == 400
        _, s = await scrape(f"{base}/metrics")
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        for agent in agents:
            await agent.close()
    assert value(s, "pushkv_router_requests_total", outcome="ok") == 1
    assert value(s, "pushkv_router_requests_total", outcome="client_error") == 1
    assert value(s, "pushkv_router_requests_total", outcome="aborted") == 0
    assert value(s, "pushkv_router_ttft_seconds_count") == 1
    assert 0 < value(s, "pushkv_router_ttft_seconds_sum") < WAIT
    assert value(s, "pushkv_router_inflight_requests") == 0


def test_outcomes_are_bounded() -> None:
    assert [outcome_of(c) for c in (200, 400, 413, 502, 503, 500, 429)] == [
        "ok",
        "client_error",
        "client_error",
        "engine_error",
        "unavailable",
        "engine_error",
        "unavailable",
    ]


# The connector's counters reach vLLM's own /metrics: tests/test_connector_stats.py
# (vLLM's stats API) and tests/test_e2e_vllm.py (a real engine's /metrics).
