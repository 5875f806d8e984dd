"""Progressive push (agent/progressive.py): an armed order written chunk by
chunk during a chunked prefill. The plan is checked directly; the rest with
real NIXL between KV hosts in separate processes and a real coordinator."""

from __future__ import annotations

import pytest

from pushkv.agent.events import EventKind
from pushkv.agent.messages import FireMsg, OrderMsg, Target
from pushkv.agent.progressive import chunk_writes, progressive_ok
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import KVHost
from pushkv.rules.block_groups import of
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.kvpair import (
    CANARY,
    begin,
    coord_fixture,  # noqa: F401
    pair_fixture,  # noqa: F401
    register,
    stubs,
    wait_state,
)
from tests.support.waits import wait_until

TPB = 16


def order(dst: tuple[int, ...], n: int, targets: int = 1) -> OrderMsg:
    tgts = tuple(Target("D", r, "i", of(), of(dst), 1) for r in range(targets))
    return OrderMsg("o", "t", 0, tgts, 4e9, num_tokens=n, armed=True)


def chunk(held: tuple[int, ...], n: int, computed: int) -> FireMsg:
    return FireMsg("t", of(held), n, computed, final=False)


def test_each_chunk_writes_the_whole_blocks_it_added() -> None:
    o = order((50, 51, 52, 53, 54), 4 * TPB + 5)
    held = (1, 2, 3, 4, 5, 6)  # the prompt's 5 blocks and one for the sampled token
    assert chunk_writes(o, chunk(held[:3], o.num_tokens, 40), 0, TPB) == (
        [(o.targets[0], of((1, 2)), of((50, 51)))],
        2,
    )
    # 47 tokens: still two whole blocks, nothing new.
    assert chunk_writes(o, chunk(held[:3], o.num_tokens, 47), 2, TPB) == ([], 2)
    assert chunk_writes(o, chunk(held[:4], o.num_tokens, 64), 2, TPB) == (
        [(o.targets[0], of((3, 4)), of((52, 53)))],
        4,
    )
    final = FireMsg("t", of(held), o.num_tokens)
    assert chunk_writes(o, final, 4, TPB) == ([(o.targets[0], of((5,)), of((54,)))], 5)


def test_a_decode_prefix_hit_skips_the_blocks_decode_has() -> None:
    o = order((60, 61), 4 * TPB)  # decode had the first 2 of 4 prompt blocks cached
    held = (1, 2, 3, 4)
    assert chunk_writes(o, chunk(held[:2], o.num_tokens, 32), 0, TPB) == ([], 2)
    assert chunk_writes(o, chunk(held[:3], o.num_tokens, 48), 2, TPB) == (
        [(o.targets[0], of((3,)), of((60,)))],
        3,
    )
    final = FireMsg("t", of(held), o.num_tokens)
    assert chunk_writes(o, final, 3, TPB) == ([(o.targets[0], of((4,)), of((61,)))], 4)


def test_the_final_fire_names_every_target_even_with_nothing_left() -> None:
    o = order((70,), TPB, targets=2)
    final = FireMsg("t", of((9,)), TPB)
    result = chunk_writes(o, final, 1, TPB)
    assert not isinstance(result, str), result  # a str says why it was refused
    writes, upto = result
    assert [(t.decode_rank, s, d) for t, s, d in writes] == [(0, (), ()), (1, (), ())]
    assert upto == 1


def test_a_chunk_that_does_not_fit_is_refused() -> None:
    o = order((50, 51), 2 * TPB)
    assert "num_tokens" in str(chunk_writes(o, chunk((1, 2), 33, 16), 0, TPB))
    assert "holds 1 blocks" in str(chunk_writes(o, chunk((1,), 2 * TPB, 32), 0, TPB))
    two_groups = FireMsg("t", of((1,), (2,)), 2 * TPB, 16, final=False)
    assert "2 KV groups" in str(chunk_writes(o, two_groups, 0, TPB))
    hybrid = OrderMsg("o", "t", 0, (Target("D", 0, "i", of(), of((1,), (2,)), 1),), 0.0)
    assert progressive_ok(o) and not progressive_ok(hybrid)


# ---------------------------------------------------------------- real NIXL


def fire(p: KVHost, tid: str, held: list[int], n: int, computed: int = 0, **kw: bool) -> None:
    final = kw.get("final", computed == 0)
    p.call("fire", [(tid, (tuple(held),), n, computed, final, kw.get("restart", False))])


@pytest.mark.timeout(120)
def test_chunks_land_before_the_prefill_ends_and_decode_is_told_once(
    coord: CoordinatorProcess, pair: tuple[KVHost, KVHost]
) -> None:
    req, status = stubs(coord)
    p, d = pair
    src, dst, n = [3, 17, 4, 40, 41], [50, 2, 33, 61, 9], 4 * TPB + 5
    p.fill(src, seed=31)
    d.call("canary", CANARY)
    d.call("expect", ["g1"])
    begin(req, "g1")
    register(req, "g1", dst, n)
    fire(p, "g1", src[:3], n, 2 * TPB + 3)  # two whole blocks computed
    wait_until(lambda: d.check(dst[:2], seed=31) == [], "the first chunk landed", 20)
    assert d.call("check_canary", dst[2:], CANARY) == []
    assert d.pending_events() == []  # no notification with a chunk
    fire(p, "g1", src[:4], n, 4 * TPB)
    wait_until(lambda: d.check(dst[:4], seed=31) == [], "the second chunk landed", 20)
    assert d.pending_events() == []
    fire(p, "g1", src, n)
    assert d.wait_event("g1").kind is EventKind.KV_READY
    assert d.check(dst, seed=31) == []
    assert p.wait_event("g1").kind is EventKind.BLOCKS_FREE
    t = wait_state(status, "g1", pb.TRANSFER_STATE_COMPLETE)
    assert [(r.state, r.arrived, r.posts) for r in t.ranks] == [(pb.RANK_STATE_DONE, True, 3)]
    assert p.call("writes_posted") == 3 and p.call("fired") == 1
    # Nothing is in flight any more: the NIXL threads stop polling fast (the
    # prefill's shares its core with the next forward).
    wait_until(lambda: not p.call("fast_polling"), "the prefill agent backs off", 10)
    wait_until(lambda: not d.call("fast_polling"), "the decode agent backs off", 10)


@pytest.mark.timeout(120)
def test_a_cancel_mid_prefill_stops_the_chunks_and_frees_once_they_settled(
    coord: CoordinatorProcess, pair: tuple[KVHost, KVHost]
) -> None:
    req, status = stubs(coord)
    p, d = pair
    src, dst, n = [5, 6, 7], [20, 21, 22], 3 * TPB
    p.fill(src, seed=41)
    d.call("canary", CANARY)
    d.call("expect", ["g2"])
    begin(req, "g2")
    register(req, "g2", dst, n)
    p.call("hold", ["g2"])
    fire(p, "g2", src[:1], n, TPB)
    wait_until(lambda: d.check(dst[:1], seed=41) == [], "the first chunk landed", 20)
    req.Cancel(pb.CancelRequest(transfer_id="g2", reason="client left"), timeout=10)
    assert p.wait_event("g2").kind is EventKind.BLOCKS_FREE
    assert d.wait_event("g2").kind is EventKind.KV_FAILED  # once nothing can land
    t = wait_state(status, "g2", pb.TRANSFER_STATE_CANCELLED)
    assert [r.state for r in t.ranks] == [pb.RANK_STATE_DROPPED] and not t.write_may_land
    fire(p, "g2", src, n)  # the prefill ends after all: nothing more is written
    assert p.call("writes_posted") == 1
    assert d.call("check_canary", dst[1:], CANARY) == []


@pytest.mark.timeout(120)
def test_a_preempted_prefill_rewrites_every_block_from_its_new_ones(
    coord: CoordinatorProcess, pair: tuple[KVHost, KVHost]
) -> None:
    """vLLM freed the blocks a chunk was written from and recomputed the
    prompt elsewhere: the final fire (restart) rewrites all, after the chunk
    settled, from the new blocks."""
    req, status = stubs(coord)
    p, d = pair
    old, new, dst, n = [1, 2, 3], [10, 11, 12], [30, 31, 32], 3 * TPB
    p.fill(old, seed=99)  # what the freed blocks hold now: not this prompt's KV
    p.fill(new, seed=51)
    d.call("expect", ["g3"])
    begin(req, "g3")
    register(req, "g3", dst, n)
    fire(p, "g3", old[:2], n, 2 * TPB)
    wait_until(lambda: d.check(dst[:2], seed=99) == [], "the chunk landed", 20)
    fire(p, "g3", new, n, restart=True)
    assert d.wait_event("g3").kind is EventKind.KV_READY
    assert d.check(dst, seed=51) == []
    t = wait_state(status, "g3", pb.TRANSFER_STATE_COMPLETE)
    assert [r.posts for r in t.ranks] == [2]  # the chunk, then the rewrite
