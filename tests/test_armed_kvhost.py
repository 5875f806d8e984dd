"""Armed orders between agents in separate processes with real NIXL, against a
real coordinator process: decode registers first, the prefill agent holds its
order armed and fires it itself (harness KV host command "fire", as the
connector's worker does after the request's last prefill forward)."""

from __future__ import annotations

import pytest

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import KVHost
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.kvpair import (
    CANARY,
    NB,
    begin,
    coord_fixture,  # noqa: F401
    hosts,
    pair_fixture,  # noqa: F401
    prefill_done,
    register,
    stages,
    stop_all,
    stubs,
    wait_state,
)
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("fire_first", [False, True], ids=["order-first", "fire-first"])
def test_the_fire_posts_the_write_before_prefill_done_is_reported(
    coord: CoordinatorProcess, pair: tuple[KVHost, KVHost], fire_first: bool
) -> None:
    """Prefill's blocks come from the fire, not the coordinator: the WRITE is
    posted and the KV lands before the coordinator hears prefill is done."""
    req, status = stubs(coord)
    p, d = pair
    src, dst, n = [3, 17, 4, 40], [50, 2, 33, 61], 3 * 16 + 5
    p.fill(src, seed=21)
    d.call("canary", CANARY)
    d.call("expect", ["a1"])
    if fire_first:
        p.call("fire", [("a1", (tuple(src),), n)])
    begin(req, "a1")
    t = register(req, "a1", dst, n)
    assert t.state == pb.TRANSFER_STATE_ARMED
    if not fire_first:
        p.call("fire", [("a1", (tuple(src),), n)])
    assert d.wait_event("a1").kind is EventKind.KV_READY
    assert p.wait_event("a1").kind is EventKind.BLOCKS_FREE
    assert d.check(dst, seed=21) == []
    assert d.call("check_canary", [b for b in range(NB) if b not in dst], CANARY) == []
    t = wait_state(status, "a1", pb.TRANSFER_STATE_COMPLETE)
    assert t.state == pb.TRANSFER_STATE_COMPLETE
    assert "prefill_done" not in stages(status, "a1")
    # The report still comes (request_finished); it finds the transfer done.
    late = prefill_done(req, "a1", src, n)
    assert late.state == pb.TRANSFER_STATE_COMPLETE and not late.write_may_land
    assert p.call("fired") == 1 and p.call("writes_posted") == 1


def test_a_decode_prefix_hit_writes_the_prompt_tail(
    coord: CoordinatorProcess, pair: tuple[KVHost, KVHost]
) -> None:
    req, _ = stubs(coord)
    p, d = pair
    head, tail = [7, 8], [9, 10]
    n = 3 * 16 + 2  # 4 prompt blocks; decode had the first 2 cached
    p.fill(head, seed=1)
    p.fill(tail, seed=2)
    d.call("expect", ["a2"])
    begin(req, "a2")
    register(req, "a2", [30, 31], n)
    # Prefill holds the prompt's 4 blocks and one for the sampled token.
    p.call("fire", [("a2", (tuple(head + tail + [11]),), n)])
    assert d.wait_event("a2").kind is EventKind.KV_READY
    assert d.check([30, 31], seed=2) == []


def test_cancel_before_the_fire_disarms_it(
    coord: CoordinatorProcess, pair: tuple[KVHost, KVHost]
) -> None:
    req, status = stubs(coord)
    p, d = pair
    d.call("canary", CANARY)
    d.call("expect", ["a3"])
    begin(req, "a3")
    register(req, "a3", [1, 2], 20)
    t = req.Cancel(pb.CancelRequest(transfer_id="a3", reason="client left"), timeout=10)
    assert t.state == pb.TRANSFER_STATE_CANCELLED
    assert d.wait_event("a3").kind is EventKind.KV_FAILED  # once no WRITE can land
    t = wait_state(status, "a3", pb.TRANSFER_STATE_CANCELLED)
    assert [r.state for r in t.ranks] == [pb.RANK_STATE_DROPPED] and not t.write_may_land
    # The request's prompt completes after all: nothing is posted.
    p.call("fire", [("a3", ((5, 6),), 20)])
    assert p.call("fired") == 0
    assert p.call("writes_posted") == 0
    assert d.call("check_canary", list(range(NB)), CANARY) == []


def test_abort_after_the_fire_drops_an_unposted_write_and_frees_the_blocks(
    coord: CoordinatorProcess, pair: tuple[KVHost, KVHost]
) -> None:
    req, status = stubs(coord)
    p, d = pair
    d.call("canary", CANARY)
    d.call("expect", ["a4"])
    p.call("pause", True)  # the fired order queues instead of posting
    begin(req, "a4")
    register(req, "a4", [1, 2], 20)
    p.call("hold", ["a4"])
    p.call("fire", [("a4", ((5, 6),), 20)])
    # The armed order may reach the agent after the fire: abort once the two
    # met and the WRITE is queued (an abort before the order came is
    # test_an_order_that_comes_after_the_abort_writes_nothing).
    wait_until(lambda: p.call("fired") == 1, "the fired order queued")
    p.call("abort", ["a4"])
    assert p.wait_event("a4").kind is EventKind.BLOCKS_FREE
    p.call("pause", False)
    t = wait_state(status, "a4", pb.TRANSFER_STATE_FAILED)
    assert t.state == pb.TRANSFER_STATE_FAILED and "aborted" in t.detail
    assert d.wait_event("a4").kind is EventKind.KV_FAILED
    assert p.call("writes_posted") == 0
    assert d.call("check_canary", list(range(NB)), CANARY) == []


def test_an_order_that_comes_after_the_abort_writes_nothing(
    coord: CoordinatorProcess, pair: tuple[KVHost, KVHost]
) -> None:
    req, status = stubs(coord)
    p, d = pair
    d.call("canary", CANARY)
    d.call("expect", ["a5"])
    p.call("hold", ["a5"])
    p.call("fire", [("a5", ((5, 6),), 20)])  # remembered: no order yet
    p.call("abort", ["a5"])
    assert p.wait_event("a5").kind is EventKind.BLOCKS_FREE  # nothing in flight
    begin(req, "a5")
    register(req, "a5", [1, 2], 20)  # the armed order finds the blocks freed
    t = wait_state(status, "a5", pb.TRANSFER_STATE_FAILED)
    assert "blocks of this transfer were released" in t.detail
    assert d.wait_event("a5").kind is EventKind.KV_FAILED
    assert p.call("fired") == 0 and p.call("writes_posted") == 0
    assert d.call("check_canary", list(range(NB)), CANARY) == []


def test_a_fire_that_disagrees_with_decode_fails_at_once(
    coord: CoordinatorProcess, pair: tuple[KVHost, KVHost]
) -> None:
    """A prefill holding fewer prompt blocks than decode registered, or another
    token count: the agent refuses to fire, and decode learns it at once."""
    req, status = stubs(coord)
    p, d = pair
    d.call("canary", CANARY)
    for tid, blocks, n in (("a5", (5,), 40), ("a6", (5, 6, 7), 41)):
        d.call("expect", [tid])
        begin(req, tid)
        register(req, tid, [1, 2, 3], 40)
        p.call("fire", [(tid, (blocks,), n)])
        assert d.wait_event(tid).kind is EventKind.KV_FAILED
        t = wait_state(status, tid, pb.TRANSFER_STATE_FAILED)
        assert t.reason == pb.REASON_WRITE_FAILED and "cannot fire" in t.detail
    assert p.call("writes_posted") == 0
    assert d.call("check_canary", list(range(NB)), CANARY) == []


def test_tp2_prefill_ranks_fire_on_their_own_and_decode_counts_both(
    coord: CoordinatorProcess,
) -> None:
    req, status = stubs(coord)
    ps, ds = hosts(coord, tp=2)
    try:
        src, dst = [1, 5, 9], [7, 3, 12]
        for r, h in enumerate(ps):
            h.fill(src, seed=300 + r)
        for h in ds:
            h.call("expect", ["a7"])
        begin(req, "a7")
        register(req, "a7", dst, 40)
        ps[0].call("fire", [("a7", (tuple(src),), 40)])
        assert ds[0].wait_event("a7").kind is EventKind.KV_READY
        t = status.GetTransfer(pb.GetTransferRequest(transfer_id="a7"), timeout=5)
        assert t.state != pb.TRANSFER_STATE_COMPLETE  # rank 1 has not fired
        ps[1].call("fire", [("a7", (tuple(src),), 40)])
        for r, h in enumerate(ds):
            if r == 1:
                assert h.wait_event("a7").kind is EventKind.KV_READY
            assert h.check(dst, seed=300 + r) == []
        t = wait_state(status, "a7", pb.TRANSFER_STATE_COMPLETE)
        assert t.state == pb.TRANSFER_STATE_COMPLETE
    finally:
        stop_all(ps, ds)
