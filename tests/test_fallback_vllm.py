"""Failures the client never sees, on real vLLM engines: when the push cannot
happen (the prefill engine dies, the coordinator dies, clients abort in a
storm), every request still gets the single-engine answer, through the decode
engine computing the KV itself, and a decode engine set to fail fast gets,
from the router, a clean status naming the stage.

The reference outputs come from an independent engine with no connector.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.vllm_server import RouterProcess, VllmServer, metric_value, pushkv_server
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.reference import ReferenceEngines
from tests.support.serving import TERMINAL, post_status

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

USAGE = "vllm:kv_cache_usage_perc"
# Coordinator: a short lease, so a dead engine's transfers fail fast.
COORD_FLAGS = ("--lease-s", "2", "--heartbeat-interval-s", "0.5", "--write-timeout-s", "3")
# Decode: a registration whose outcome is unknown (coordinator gone) is failed,
# and so recomputed, after this long: longer than the write timeout (3 s) plus
# an agent lease (2 s), so no WRITE can still land in its blocks.
UNCERTAIN_GRACE_S = 8.0
# Every request must be answered within this bound: the grace above, plus
# generous room for two engines sharing two cores and recomputing a burst.
ANSWER_S = 90.0
# A client of the abort storm that stays is answered within this long.
STAY_S = 120.0
# After an abort storm, every transfer must be terminal within this long.
STORM_SETTLE_S = 5.0
BURST = 12


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randrange(40, 300))] for _ in range(n)]


# A burst of its own for each test: a prompt the decode engine served before is
# a local prefix hit there, whose transfer completes at once (nothing to move).
STORM, RESTART, FOR_GOOD, PREFILL_KILL = (prompts(BURST, seed) for seed in (7, 9, 10, 11))
PROMPTS = STORM + RESTART + FOR_GOOD + PREFILL_KILL
FRESH = prompts(4, 8)


def body(prompt: list[int]) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}


def post(url: str, payload: dict[str, Any], timeout: float = ANSWER_S) -> tuple[int, Any]:
    return post_status(url, payload, timeout)


def text(answer: Any) -> str:
    return str(answer["choices"][0]["text"])


@dataclass
class Cluster:
    model: Path
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess
    reference: dict[tuple[int, ...], str]

    def complete(self, prompt: list[int], url: str | None = None) -> tuple[int, Any]:
        return post((url or self.router.url) + "/v1/completions", body(prompt))

    def expect(self, prompt: list[int]) -> str:
        return self.reference[tuple(prompt)]

    def status(self) -> pbg.StatusServiceStub:
        return pbg.StatusServiceStub(grpc.insecure_channel(self.coord.address))

    def transfers(self) -> list[pb.TransferStatus]:
        listed = self.status().ListTransfers(pb.ListTransfersRequest(limit=1000), timeout=10)
        return list(listed.transfers)

    def start_prefill(self, engine_id: str) -> None:
        self.prefill = pushkv_server(
            self.model, "prefill", engine_id, self.coord.address, cpu_core=0
        ).start()
        self.prefill.wait_ready()


def wait_until(what: str, check: Any, timeout: float) -> Any:
    """Poll `check` (engine metrics or the coordinator) until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)  # polling another process's state under a deadline
    raise AssertionError(f"{what} not within {timeout} s (last: {last!r})")


def router_health(url: str) -> dict[str, Any]:
    """The router's /health body, whether it answers 200 or 503."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            out: dict[str, Any] = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        out = json.loads(exc.read())
    return out


def no_blocks_held(*servers: VllmServer) -> bool:
    return all(metric_value(s.metrics(), USAGE) == 0 for s in servers)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, references: ReferenceEngines) -> Iterator[Cluster]:
    # The independent engine's answers (no connector at all), as body() asks.
    outputs = references.outputs(tiny_model_dir, PROMPTS + FRESH, body([])["max_tokens"])
    reference = {tuple(p): o for p, o in zip(PROMPTS + FRESH, outputs, strict=True)}

    coord = CoordinatorProcess("--log-level", "WARNING", *COORD_FLAGS).start()
    prefill = pushkv_server(tiny_model_dir, "prefill", "prefill-0", coord.address, cpu_core=0)
    decode = pushkv_server(
        tiny_model_dir,
        "decode",
        "decode-0",
        coord.address,
        cpu_core=1,
        extra_config={"uncertain_grace_s": UNCERTAIN_GRACE_S},
    )
    router = RouterProcess(coord.address)
    c = Cluster(tiny_model_dir, coord, prefill, decode, router, reference)
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        router.start()
        yield c
    finally:
        c.router.stop()
        c.prefill.stop()
        c.decode.stop()
        c.coord.stop()


def burst(c: Cluster, ps: list[list[int]]) -> list[Future[tuple[int, Any]]]:
    pool = ThreadPoolExecutor(len(ps))
    futures = [pool.submit(c.complete, p) for p in ps]
    pool.shutdown(wait=False)
    return futures


def assert_all_correct(c: Cluster, ps: list[list[int]], futures: list[Future[Any]]) -> None:
    for p, f in zip(ps, futures, strict=True):
        status, answer = f.result(timeout=ANSWER_S)
        assert status == 200, answer
        assert text(answer) == c.expect(p)


LIVE = [s for s in pb.TransferState.values() if s and s not in TERMINAL]


def in_flight_burst(c: Cluster, ps: list[list[int]]) -> list[Future[tuple[int, Any]]]:
    """A burst, returned once the coordinator says one of its transfers is
    short of its end. Watched, not polled: on an idle box a burst's
    transfers can begin and complete between two polls (armed orders fire as
    the prefill ends), so a poll saw none in flight for 30 s. The watch is
    opened before the burst and replays live transfers, so none is missed."""
    ch = grpc.insecure_channel(c.coord.address)
    watch = pbg.StatusServiceStub(ch).WatchTransfers(
        pb.WatchTransfersRequest(states=LIVE, include_existing=True), timeout=30
    )
    try:
        futures = burst(c, ps)
        for event in watch:  # ends with DEADLINE_EXCEEDED after 30 s
            if event.transfer.state not in TERMINAL:
                return futures
        raise AssertionError("the coordinator's watch ended before a transfer was in flight")
    finally:
        watch.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs: RpcContext.cancel is unannotated
        ch.close()


# ---------------------------------------------------------------- abort storm


def test_abort_storm_leaves_no_transfer_behind(cluster: Cluster) -> None:
    """20 clients at once, 10 of which give up after 0.05-1 s while the other
    10 stay: nothing the leavers leave behind waits for a deadline, every
    client that stayed is answered correctly, and the next request is too."""
    rng = random.Random(3)
    # Even clients leave early; odd ones stay, bounded by a deadline that only
    # a hung request reaches.
    timeouts = [rng.uniform(0.05, 1.0) if i % 2 == 0 else STAY_S for i in range(20)]
    statuses: list[int] = []
    stayed: list[int] = []
    gave_up: list[int] = []

    async def one(http: aiohttp.ClientSession, i: int, t: float) -> None:
        p = STORM[i % len(STORM)]
        try:
            async with http.post(
                cluster.router.url + "/v1/completions",
                json=body(p),
                timeout=aiohttp.ClientTimeout(total=t),
            ) as resp:
                statuses.append(resp.status)
                answer = await resp.json()
                assert resp.status == 200, answer
                assert text(answer) == cluster.expect(p)
                if t == STAY_S:
                    stayed.append(i)
        except TimeoutError:
            assert t != STAY_S, f"client {i} stayed and was not answered within {STAY_S} s"
            gave_up.append(i)

    async def storm() -> None:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(one(http, i, t) for i, t in enumerate(timeouts)))

    asyncio.run(storm())
    assert all(s == 200 for s in statuses), statuses
    assert sorted(stayed) == list(range(1, 20, 2))
    assert gave_up, "no client gave up: the storm aborted nothing"
    wait_until(
        "every transfer terminal",
        lambda: all(t.state in TERMINAL for t in cluster.transfers()),
        STORM_SETTLE_S,
    )
    expired = [t for t in cluster.transfers() if t.state == pb.TRANSFER_STATE_EXPIRED]
    assert expired == []
    p = FRESH[0]
    status, answer = cluster.complete(p)
    assert status == 200 and text(answer) == cluster.expect(p)
    wait_until("no KV blocks held", lambda: no_blocks_held(cluster.prefill, cluster.decode), 30)


# ---------------------------------------------------------------- coordinator dies


def kill_coordinator(c: Cluster) -> None:
    assert c.coord.proc is not None
    c.coord.proc.send_signal(signal.SIGKILL)
    c.coord.proc.wait(10)


def test_coordinator_killed_and_restarted(cluster: Cluster) -> None:
    futures = in_flight_burst(cluster, RESTART)
    kill_coordinator(cluster)
    cluster.coord.start()  # same port
    assert_all_correct(cluster, RESTART, futures)
    wait_until("no KV blocks held", lambda: no_blocks_held(cluster.prefill, cluster.decode), 60)
    # Pushing resumes with the new coordinator (the router and agents found it).
    p = FRESH[1]

    def pushed() -> bool:
        status, answer = cluster.complete(p)
        assert status == 200 and text(answer) == cluster.expect(p)
        return any(t.state == pb.TRANSFER_STATE_COMPLETE for t in cluster.transfers())

    wait_until("a pushed transfer after the restart", pushed, 60)


def test_coordinator_killed_for_good(cluster: Cluster) -> None:
    """In-flight requests and new ones all complete correctly: the in-flight ones
    once no WRITE can land (UNCERTAIN_GRACE_S), the new ones on the decode engine
    alone at once."""
    futures = in_flight_burst(cluster, FOR_GOOD)
    kill_coordinator(cluster)
    fresh = burst(cluster, FRESH)
    assert_all_correct(cluster, FOR_GOOD, futures)
    assert_all_correct(cluster, FRESH, fresh)
    fallbacks = metric_value(
        urllib.request.urlopen(cluster.router.url + "/metrics", timeout=10).read().decode(),
        "pushkv_router_fallbacks_total",
        'reason="coordinator_unavailable"',
    )
    assert fallbacks >= len(FRESH)
    wait_until("no KV blocks held", lambda: no_blocks_held(cluster.prefill, cluster.decode), 60)
    # Service comes back with the coordinator: a disaggregated transfer completes.
    cluster.coord.start()
    p = FRESH[1]

    def pushed() -> bool:
        status, answer = cluster.complete(p)
        assert status == 200 and text(answer) == cluster.expect(p)
        return any(t.state == pb.TRANSFER_STATE_COMPLETE for t in cluster.transfers())

    wait_until("a pushed transfer after the restart", pushed, 60)


# ---------------------------------------------------------------- prefill dies


def test_prefill_engine_killed_during_a_burst(cluster: Cluster) -> None:
    futures = in_flight_burst(cluster, PREFILL_KILL)
    assert cluster.prefill.proc is not None
    os.killpg(cluster.prefill.proc.pid, signal.SIGKILL)
    assert_all_correct(cluster, PREFILL_KILL, futures)
    wait_until("no KV blocks held on decode", lambda: no_blocks_held(cluster.decode), 60)
    cluster.prefill.stop()


def test_a_fail_fast_decode_engine_gets_a_503_naming_the_stage(cluster: Cluster) -> None:
    """A decode engine set to on_transfer_failure "fail": with the prefill
    engine dead, the router, which follows that engine's setting (there is no
    router setting to disagree with it), answers a clean 503 that says so, not
    a recompute, and not a bare 500."""
    cluster.decode.stop()
    cluster.decode = pushkv_server(
        cluster.model,
        "decode",
        "decode-fail",
        cluster.coord.address,
        cpu_core=1,
        extra_config={"uncertain_grace_s": UNCERTAIN_GRACE_S, "on_transfer_failure": "fail"},
    ).start()
    cluster.decode.wait_ready()

    def routed_to_the_new_engine() -> bool:
        return bool(router_health(cluster.router.url).get("decode") == ["decode-fail"])

    wait_until("the router uses decode-fail alone", routed_to_the_new_engine, 60)
    status, answer = post(cluster.router.url + "/v1/completions", body(FRESH[2]), timeout=10)
    assert status == 503, answer
    assert answer["error"]["stage"] == "no_engine", answer
    message = answer["error"]["message"]
    assert "no prefill engine available" in message, message
    assert "(decode engine decode-fail: on_transfer_failure fail)" in message, message
    # A replacement prefill engine registers and the router pushes again.
    cluster.start_prefill("prefill-1")
    p = FRESH[3]

    def pushed() -> bool:
        status, answer = cluster.complete(p)
        assert status == 200 and text(answer) == cluster.expect(p)
        return any(
            t.state == pb.TRANSFER_STATE_COMPLETE and t.prefill_engine_id == "prefill-1"
            for t in cluster.transfers()
        )

    wait_until("a pushed transfer from the new prefill engine", pushed, 60)
