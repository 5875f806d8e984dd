"""Pipeline-parallel prefill into a PP 1 decode between stand-alone KV hosts:
real agents in separate processes, real NIXL WRITEs, a real coordinator.

Each prefill stage's hosts hold only their own layers' regions (reported as
KVRegion.layer); the decode hosts hold every layer. Contents are keyed by
layer and head (pushkv/harness/kvhost.py), so every decode host verifies that each
layer's region got that layer's bytes, whichever stage and TP rank wrote
them; each decode rank becomes ready only once every stage's writer arrived."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from pushkv.agent.events import EventKind
from pushkv.cli import main as cli
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.kvpair import stop_all as stop
from tests.test_tp_kvhost import (
    CANARY,
    DST,
    HEAD_LEN,
    HEADS,
    NB,
    SRC,
    TOKENS,
    both_sides,
    complete,
    transfer_rpcs,
    wait_for,
)


@pytest.fixture
def coord() -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess(
        "--lease-s",
        "2",
        "--heartbeat-interval-s",
        "0.5",
        "--write-timeout-s",
        "5",
        "--log-level",
        "WARNING",
    ).start()
    yield c
    c.stop()


def hosts(
    c: CoordinatorProcess,
    eid: str,
    role: str,
    stages: list[tuple[int, ...]],
    tp: int,
    *,
    report_layers: bool = True,
) -> list[KVHost]:
    """One engine: len(stages) PP stages of `tp` KV hosts, stage s holding the
    regions of layers stages[s] (in that order); ranks in engine rank order
    (pp_rank * tp + tp_rank)."""
    per = HEADS // tp
    out = [
        KVHost(
            HostSpec(
                c.address,
                eid,
                role,
                t,
                tp,
                NB,
                block_len=per * HEAD_LEN,
                num_regions=len(layers),
                kv_heads=per,
                pp_rank=s,
                pp_size=len(stages),
                layers=layers if report_layers else (),
            )
        )
        for s, layers in enumerate(stages)
        for t in range(tp)
    ]
    for h in out:
        h.start()
    return out


LAYERS = 5
SPLIT = [(0, 1), (2, 3, 4)]  # uneven, as vLLM splits 5 layers over 2 stages


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "d_layers"),
    [
        (1, 1, tuple(range(LAYERS))),
        (1, 2, tuple(range(LAYERS))),
        (2, 1, tuple(range(LAYERS))),
        (2, 2, tuple(range(LAYERS))),
        (1, 1, (4, 2, 0, 3, 1)),  # decode regions in another order: paired by layer
    ],
    ids=str,
)
def test_each_stage_writes_its_layers(
    coord: CoordinatorProcess, p_tp: int, d_tp: int, d_layers: tuple[int, ...]
) -> None:
    """PP 2 (x TP p_tp) prefill into a TP d_tp decode: every layer's region of
    every decode rank holds that layer's heads, byte for byte; no other block
    changed; each decode rank counted exactly one arrival per (stage, TP
    writer) and the transfer completed with every rank done and arrived."""
    req, status = transfer_rpcs(coord)
    ps = hosts(coord, "P", "prefill", SPLIT, p_tp)
    ds = hosts(coord, "D", "decode", [d_layers], d_tp)
    try:
        for h in ds:
            h.call("canary", CANARY)
            h.call("expect", ["t"])
        for h in ps:
            h.fill(SRC, seed=7)
        both_sides(req, "t", SRC, DST, TOKENS)
        for h in ds:
            assert h.wait_event("t").kind is EventKind.KV_READY
            assert h.call("check_heads", DST, 7) == []  # every layer, every head
            untouched = [b for b in range(NB) if b not in DST]
            assert h.call("check_canary", untouched, CANARY) == []
        for h in ps:
            assert h.wait_event("t").kind is EventKind.BLOCKS_FREE
        t = wait_for(status, "t", complete)
        assert complete(t), t
        ranks = len(SPLIT) * p_tp
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (r, pb.RANK_STATE_DONE, True) for r in range(ranks)
        ]
        assert list(t.outstanding_ranks) == [] and not t.write_may_land
        # One arrival per (decode rank, prefill rank writing into it): every
        # stage's rank of each TP writer.
        arrived = Counter(e.rank for e in t.timeline if e.stage == "arrived")
        per_rank = max(1, d_tp // p_tp)
        assert arrived == {r: per_rank for r in range(ranks)}
        assert all(h.call("writes_posted") == per_rank for h in ps)
    finally:
        stop(ps, ds)


def test_decode_waits_for_every_stage(coord: CoordinatorProcess) -> None:
    """Stage 0 wrote and arrived, stage 1 has not posted: the decode rank is
    not ready (its expected writers are both stages), the transfer waits on
    stage 1's rank; once stage 1 posts, the decode is ready and every byte is
    there."""
    req, status = transfer_rpcs(coord)
    ps = hosts(coord, "P", "prefill", SPLIT, 1)
    (d,) = hosts(coord, "D", "decode", [tuple(range(LAYERS))], 1)
    try:
        d.call("canary", CANARY)
        d.call("expect", ["w"])
        for h in ps:
            h.fill(SRC, seed=3)
        ps[1].call("pause", True)
        both_sides(req, "w", SRC, DST, TOKENS)

        def stage0_arrived(s: pb.TransferStatus) -> bool:
            # Its DONE report and the decode's arrival may come in either
            # order: wait for both (a CI run saw the arrival first).
            return any(
                r.prefill_rank == 0 and r.arrived and r.state == pb.RANK_STATE_DONE for r in s.ranks
            )

        t = wait_for(status, "w", stage0_arrived)
        assert stage0_arrived(t), t
        # (ORDERED or WRITING, as stage 0's reports and its arrival interleave)
        assert t.state in (pb.TRANSFER_STATE_ORDERED, pb.TRANSFER_STATE_WRITING), t
        assert list(t.outstanding_ranks) == [1]
        assert [e for e in d.pending_events() if e.transfer_id == "w"] == []
        ps[1].call("pause", False)
        assert d.wait_event("w").kind is EventKind.KV_READY
        assert d.call("check_heads", DST, 3) == []
        assert complete(wait_for(status, "w", complete))
    finally:
        stop(ps, [d])


@pytest.mark.parametrize(
    ("p_stages", "d_stages", "report", "why"),
    [
        # Stage 1 lacks layer 4: the stages' layers together are not decode's.
        (
            [(0, 1), (2, 3)],
            [(0, 1, 2, 3, 4)],
            True,
            "the prefill stages' layers together must be the decode engine's",
        ),
        # Both stages hold layer 1.
        ([(0, 1), (1, 2, 3, 4)], [(0, 1, 2, 3, 4)], True, "more regions than decode: [1]"),
        ([(0, 1), (2, 3, 4)], [(0, 1), (2, 3, 4)], True, "decode pipeline parallelism (PP 2)"),
        ([(0, 1), (2, 3, 4)], [(0, 1, 2, 3, 4)], False, "does not report every KV region's layer"),
    ],
    ids=["missing-layer", "duplicate-layer", "decode-pp", "no-layers"],
)
def test_unpairable_pipelines_are_refused(
    coord: CoordinatorProcess,
    p_stages: list[tuple[int, ...]],
    d_stages: list[tuple[int, ...]],
    report: bool,
    why: str,
) -> None:
    req, _ = transfer_rpcs(coord)
    ps = hosts(coord, "P", "prefill", p_stages, 1, report_layers=report)
    ds = hosts(coord, "D", "decode", d_stages, 1)
    try:
        t = both_sides(req, "r", SRC, DST, TOKENS)
        assert t.state == pb.TRANSFER_STATE_FAILED and t.reason == pb.REASON_MISMATCH
        assert why in t.detail, t.detail
        assert not t.ranks  # no order was issued
        assert all(h.call("writes_posted") == 0 for h in ps)
    finally:
        stop(ps, ds)


def test_status_lists_every_stage(
    coord: CoordinatorProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """ListEngines: a PP 2 x TP 2 engine is ready with its 4 ranks, each with
    its stage, and its KV shape lists both stages' regions with their layers;
    `pushkv status engines` shows each rank's stage and TP rank."""
    ps = hosts(coord, "P", "prefill", SPLIT, 2)
    try:
        _, status = transfer_rpcs(coord)
        (e,) = status.ListEngines(pb.ListEnginesRequest(), timeout=5).engines
        assert (e.tp_size, e.pp_size, e.ready) == (2, 2, True)
        assert [(r.tp_rank, r.pp_rank) for r in e.ranks] == [(0, 0), (1, 0), (2, 1), (3, 1)]
        assert e.kv.pp_size == 2
        assert [r.layer for r in e.kv.regions] == [0, 1, 2, 3, 4]
        assert cli.main(["status", "--coordinator", coord.address, "engines"]) == 0
        table = [line.split() for line in capsys.readouterr().out.splitlines()]
        assert [r[2] for r in table if r and r[0] == "P"] == [
            "pp0/2.tp0/2",
            "pp0/2.tp1/2",
            "pp1/2.tp0/2",
            "pp1/2.tp1/2",
        ]
    finally:
        stop(ps)
