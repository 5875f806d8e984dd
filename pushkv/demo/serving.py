"""`pushkv demo`: a real 1P1D run on this machine.

Builds the tiny local model, starts a coordinator, a prefill and a decode vLLM
server (each on its own core, with the pushkv connector) and the router, sends
prompts of varied lengths concurrently, and prints each request's output, its
TTFT and its transfer's status. Then, on the cores the run freed, an
independent vLLM server with no KV connector answers the same prompts one by
one: the greedy reference every output is compared with (as the end-to-end
tests compare theirs).
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.tiny_model import build_tiny_model
from pushkv.harness.vllm_server import PushkvCluster, VllmServer, metric_value
from pushkv.tools.tables import engines_table, transfers_table
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

MODEL_DIR = Path(".cache/tiny-model")
BLOCK = 32


def _say(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _stream(url: str, body: dict[str, Any]) -> tuple[str, float, str]:
    """POST a streaming completion; return (text, TTFT seconds, transfer id)."""
    req = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.monotonic()
    ttft = -1.0
    text: list[str] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft < 0:
                ttft = time.monotonic() - started
            chunk = json.loads(line[6:])
            text.extend(c.get("text", "") for c in chunk.get("choices", []))
    return "".join(text), ttft, ""


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@dataclass
class Disaggregated:
    """What the 1P1D run left: each request's (text, TTFT), the status tables,
    the transfers complete, and the prompt tokens decode loaded as external KV."""

    results: list[tuple[str, float, str]]
    tables: str
    complete: int
    loaded: float


def _disaggregated(
    coord: CoordinatorProcess, model: Path, prompts: list[list[int]], body: dict[str, Any]
) -> Disaggregated:
    cluster = PushkvCluster.around(coord.address, model, block_size=BLOCK)
    decode, router = cluster.decode, cluster.router
    try:
        _say(
            f"coordinator on {coord.address}; starting prefill and decode vLLM servers "
            "(about a minute on 2 cores) ..."
        )
        cluster.start_engines()
        cluster.start_router()
        _say(f"router on {router.url}; sending {len(prompts)} requests concurrently")
        external = ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
        before = metric_value(decode.metrics(), *external)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda p: _stream(router.url + "/v1/completions", {**body, "prompt": p}),
                    prompts,
                )
            )
        after = metric_value(decode.metrics(), *external)
        status = pbg.StatusServiceStub(grpc.insecure_channel(coord.address))
        listed = status.ListTransfers(pb.ListTransfersRequest(limit=1000), timeout=10)
        engines = status.ListEngines(pb.ListEnginesRequest(), timeout=10).engines
        return Disaggregated(
            results,
            transfers_table(listed.transfers) + "\n\n" + engines_table(engines),
            sum(t.state == pb.TRANSFER_STATE_COMPLETE for t in listed.transfers),
            after - before,
        )
    finally:
        cluster.stop()


def _reference(model: Path, prompts: list[list[int]], body: dict[str, Any]) -> list[str]:
    """Each prompt's greedy output on an independent engine: a vLLM server with
    no KV connector (no pushkv code on its path), started once the 1P1D run
    has freed the cores, as the end-to-end tests build theirs."""
    ref = VllmServer(model, "reference", cpu_core=0, block_size=BLOCK)
    assert ref.kv_transfer_config is None
    try:
        ref.start().wait_ready()
        return [
            str(_post(ref.url + "/v1/completions", {**body, "prompt": p})["choices"][0]["text"])
            for p in prompts
        ]
    finally:
        ref.stop()


def run(requests: int = 12, model_dir: Path = MODEL_DIR) -> int:
    t0 = time.monotonic()
    _say("building the tiny local model (no downloads) ...")
    model = build_tiny_model(model_dir)
    rng = random.Random(3)
    lengths = [rng.choice([8, 31, 32, 33, 64, 100, 200, 333, 500]) for _ in range(requests)]
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0}
    with CoordinatorProcess("--log-level", "WARNING") as coord:
        run_1p1d = _disaggregated(coord, model, prompts, body)
    _say(
        "1P1D done; starting the reference, an independent vLLM server with no KV "
        "connector (about half a minute) ...\n"
    )
    refs = _reference(model, prompts, body)
    same = 0
    for i, ((text, ttft, _), ref) in enumerate(zip(run_1p1d.results, refs, strict=True)):
        ok = text == ref
        same += ok
        _say(
            f"req {i:2d}  prompt {len(prompts[i]):4d} tok  TTFT {ttft * 1000:7.1f} ms  "
            f"{'== reference' if ok else '!= reference'}  output {text!r:.60}"
        )
    _say("\n" + run_1p1d.tables)
    _say(
        f"\n{same}/{requests} outputs equal an independent single engine's (no connector) "
        f"greedy output; {run_1p1d.complete}/{requests} transfers complete; decode loaded "
        f"{run_1p1d.loaded:.0f} of {sum(lengths)} prompt tokens as external KV; "
        f"{time.monotonic() - t0:.0f} s"
    )
    return 0 if same == requests and run_1p1d.complete == requests else 1


if __name__ == "__main__":
    raise SystemExit(run())
