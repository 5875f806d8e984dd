"""HTTP and status helpers for end-to-end tests against real vLLM servers."""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pushkv.harness.vllm_server import VllmServer, metric_value
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

EXTERNAL = "vllm:prompt_tokens_by_source_total"
USAGE = "vllm:kv_cache_usage_perc"

# Prompt lengths around a 32-token block: shorter than a block, exactly one,
# one over, several, partial last block, many blocks.
VARIED_LENGTHS: tuple[int, ...] = (5, 17, 31, 32, 33, 63, 64, 65, 96, 100, 127, 128, 129, 160)
VARIED_LENGTHS += (200, 255, 256, 300, 383, 450, 511, 600)


def varied_prompts(seed: int, lengths: tuple[int, ...] = VARIED_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]


def post(url: str, body: dict[str, Any], timeout: float = 180) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def json_request(url: str, body: dict[str, Any]) -> urllib.request.Request:
    """A JSON POST (for a streamed answer the caller reads itself)."""
    return urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def post_status(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, Any]:
    """POST JSON; (HTTP status, decoded body) whether or not the status is an error."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def completion(url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return str(post(url + "/v1/completions", body)["choices"][0]["text"])


def concurrently(url: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """The prompts sent to `url`, all in flight at once."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: completion(url, p, max_tokens), prompts))


def one_by_one(url: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Reference outputs, one prompt at a time; non-empty and not all equal."""
    out = [completion(url, p, max_tokens) for p in prompts]
    assert all(out), f"reference produced an empty output: {out}"
    assert len(prompts) < 2 or len(set(out)) > 1, f"reference outputs all equal: {out[0]!r}"
    return out


def router_engines(router_url: str, role: str) -> list[str]:
    """The engines of `role` ("prefill" or "decode") a router pairs requests
    with (its /health; a 503, no pair, lists the same)."""
    try:
        with urllib.request.urlopen(router_url + "/health", timeout=10) as resp:
            return list(json.load(resp)[role])
    except urllib.error.HTTPError as exc:
        return list(json.load(exc)[role])


def external_tokens(metrics_text: str) -> float:
    """Prompt tokens an engine loaded through its KV connector (not computed)."""
    return metric_value(metrics_text, EXTERNAL, 'source="external_kv_transfer"')


def connector_count(server: VllmServer, metric: str, engine_id: str, rank: int) -> float:
    """A connector counter of one worker rank, as the engine's own /metrics
    serves it (vllm_integration/stats.py; 0 before the rank counted any)."""
    want = {"engine_id": engine_id, "rank": str(rank)}
    return sum(
        s.value
        for family in text_string_to_metric_families(server.metrics())
        for s in family.samples
        if s.name == metric and want.items() <= s.labels.items()
    )


def status_stub(coordinator: str) -> pbg.StatusServiceStub:
    return pbg.StatusServiceStub(grpc.insecure_channel(coordinator))


def transfers(coordinator: str) -> list[pb.TransferStatus]:
    resp = status_stub(coordinator).ListTransfers(pb.ListTransfersRequest(limit=1000), timeout=10)
    return list(resp.transfers)


def engines(coordinator: str) -> dict[str, pb.EngineStatus]:
    resp = status_stub(coordinator).ListEngines(pb.ListEnginesRequest(), timeout=10)
    return {e.engine_id: e for e in resp.engines}


TERMINAL = (
    pb.TRANSFER_STATE_COMPLETE,
    pb.TRANSFER_STATE_FAILED,
    pb.TRANSFER_STATE_CANCELLED,
    pb.TRANSFER_STATE_EXPIRED,
)


def settled(
    coordinator: str, count: int, skip: set[str], timeout: float = 60
) -> list[pb.TransferStatus]:
    """The first `count` transfers not in `skip` once each reached a terminal
    state (the decode engine may answer before the coordinator counted every
    rank's report). Watches the coordinator; the timeout only bounds the wait."""
    done: dict[str, pb.TransferStatus] = {}
    req = pb.WatchTransfersRequest(states=TERMINAL, include_existing=True)
    events = status_stub(coordinator).WatchTransfers(req, timeout=timeout)
    try:
        for ev in events:
            if ev.transfer.transfer_id not in skip:
                done[ev.transfer.transfer_id] = ev.transfer
                if len(done) >= count:
                    break
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    finally:
        events.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs: RpcContext.cancel is unannotated
    live = [t for t in transfers(coordinator) if t.transfer_id not in skip]
    assert len(done) >= count, f"not terminal within {timeout} s: {live}"
    return list(done.values())


def why_not_loaded(coordinator: str, skip: set[str], *logs: str) -> str:
    """For an assertion message: how the transfers not in `skip` ended (state,
    reason, per-rank states, timeline stages), those that did not complete
    first, then the pushkv, warning and error lines of the logs given (whole
    logs: a link lost early is far from their tails), then the completed
    transfers, so that a run where decode recomputed says why even where the
    message is cut in the middle."""
    failed: list[str] = []
    complete: list[str] = []
    for t in transfers(coordinator):
        if t.transfer_id in skip:
            continue
        ranks = [(r.prefill_rank, pb.RankState.Name(r.state), r.arrived) for r in t.ranks]
        stages = [(e.stage, e.rank) for e in t.timeline]
        line = (
            f"{t.transfer_id} {pb.TransferState.Name(t.state)} {pb.Reason.Name(t.reason)}"
            f" {t.detail!r} ranks={ranks} timeline={stages}"
        )
        (complete if t.state == pb.TRANSFER_STATE_COMPLETE else failed).append(line)
    lines = [f"{len(failed)} not complete, {len(complete)} complete"]
    # First, where a long message is cut last: a starved or lapsed agent.
    for text in logs:
        lines.extend([ln for ln in text.splitlines() if any(w in ln for w in KEY_MARKS)][:20])
    lines.extend(failed)
    for text in logs:
        picked = [ln for ln in text.splitlines() if any(w in ln for w in LOG_MARKS)]
        lines.extend(picked[-40:])
        lines.extend(hang_dump(text))
    lines.extend(complete)
    return "\n".join(lines)


def hang_dump(text: str, limit: int = 150) -> list[str]:
    """The first faulthandler dump in a log (the connector's hang_dump_s,
    agent/starvation.py; the coordinator's --hang-dump-s): every thread's
    stack while the process's loop or watchdog was stalled."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Thread 0x")), None)
    if start is None:
        return []
    dump = []
    for ln in lines[start:]:
        if not (ln.startswith(("Thread 0x", "Current thread 0x", "  File ")) or not ln.strip()):
            break
        dump.append(ln)
    return ["a process's threads while it was stalled:", *dump[:limit]]


# Lines why_not_loaded puts first: an agent starved by its process, its lease
# lapsed, a coordinator taken as gone or itself stalled (agent/link.py,
# agent/starvation.py, pushkv/net/event_loop.report_stalls).
KEY_MARKS = (
    "could not run for",
    "lease lapsed",
    "said nothing for",
    "coordinator_stalled",
    "did not run its event loop",
)


# The log lines why_not_loaded keeps: vLLM's warnings and errors, pushkv's
# lines in an engine's log (vllm_integration/logs.py names the pushkv logger on
# each), tracebacks, a relay's lines, and the coordinator's JSON warnings and errors.
LOG_MARKS = ("pushkv", "WARN", "ERROR", "Traceback", "relay:", '"warning"', '"error"')


def wait_no_blocks_held(*servers: VllmServer, timeout: float = 60.0) -> None:
    """Until every server's KV cache usage is 0 (no request holds a block).

    A scrape that does not answer in time (an engine starved of CPU on a
    small machine: one took over 10 s in a CI run) is a reading not taken
    yet, not a failure: the wait goes on to its deadline."""
    deadline = time.monotonic() + timeout
    usage: list[float | str] = ["not read"]
    while time.monotonic() < deadline:
        try:
            usage = [metric_value(s.metrics(), USAGE) for s in servers]
        except OSError as exc:  # a timed-out or refused scrape
            usage = [f"no answer ({exc})"]
        if all(u == 0 for u in usage):
            return
        time.sleep(0.2)  # polling engine metrics under a deadline
    raise AssertionError(f"KV blocks still held: {usage}")
