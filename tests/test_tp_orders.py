"""The coordinator's TP mapping (controlplane/orders.py): which decode rank each
prefill rank writes, at which byte slice, how many writers each decode rank
expects, and which pairs are refused and why. Pure core, no processes."""

from __future__ import annotations

import pytest

from pushkv.controlplane.domain import (
    AgentRegistration,
    EngineId,
    KVLayout,
    KVRegion,
    OrderId,
    Role,
    State,
    TransferId,
)
from pushkv.controlplane.orders import mismatch, rank_targets, source_blocks
from pushkv.controlplane.registry import AgentRecord, EngineRecord
from pushkv.controlplane.transfer import Side, Transfer
from pushkv.rules.block_groups import of

HEAD = 4096  # bytes of one KV head in one block
COMPAT = (("dtype", "float32"), ("head_size", "32"), ("model", "tiny"))


def engine(
    eid: str,
    role: Role,
    tp: int,
    *,
    heads: int = 4,
    head_major: bool = True,
    compat: tuple[tuple[str, str], ...] = COMPAT,
    regions: int = 2,
    total: int = 0,  # reported as the total_kv_heads compat field when > 0
) -> EngineRecord:
    per = max(1, heads // tp)
    if total:
        compat = (*compat, ("total_kv_heads", str(total)))
    eng = EngineRecord(EngineId(eid), role, tp, 16, "")
    for r in range(tp):
        layout = KVLayout(
            16,
            tuple(KVRegion(1 << (20 + i), per * HEAD, 64) for i in range(regions)),
            compat=compat,
            kv_heads=per,
            head_major=head_major,
        )
        reg = AgentRegistration(EngineId(eid), role, r, tp, f"inc{r}", f"{eid}-{r}", b"", layout)
        eng.ranks[r] = AgentRecord(reg, True, 0.0, 1e9)
    return eng


def transfer() -> Transfer:
    t = Transfer(TransferId("t"), State.REGISTERED, 0.0, 0.0, 60.0, 0.0)
    t.decode = Side(EngineId("D"), of((5, 6)), 20)
    t.prefill = Side(EngineId("P"), of((1, 2)), 20)
    return t


def plan(
    p_tp: int, d_tp: int, heads: int = 4, total: int = 0
) -> dict[int, list[tuple[int, int, int, int]]]:
    """prefill rank -> [(decode rank, slice offset, slice len, expected writers)]."""
    pe = engine("P", Role.PREFILL, p_tp, heads=heads, total=total)
    de = engine("D", Role.DECODE, d_tp, heads=heads, total=total)
    assert mismatch(transfer(), pe, de) == ""
    out = {}
    for r in range(p_tp):
        targets = rank_targets(pe, de, r, of((1, 2)), of((5, 6)))
        for t in targets:
            assert t.decode_incarnation == f"inc{t.decode_rank}"
            assert (t.src_blocks, t.dst_blocks) == (((1, 2),), ((5, 6),))
        out[r] = [(t.decode_rank, t.slice_offset, t.slice_len, t.expected_writers) for t in targets]
    return out


def test_equal_tp_writes_whole_blocks_rank_to_rank() -> None:
    assert plan(2, 2) == {0: [(0, 0, 0, 1)], 1: [(1, 0, 0, 1)]}


def test_prefill_tp_larger_writes_head_slices_into_shared_decode_blocks() -> None:
    # TP4 -> TP2, 4 heads: prefill rank r holds head r, decode rank d heads 2d, 2d+1.
    assert plan(4, 2) == {
        0: [(0, 0, HEAD, 2)],
        1: [(0, HEAD, HEAD, 2)],
        2: [(1, 0, HEAD, 2)],
        3: [(1, HEAD, HEAD, 2)],
    }
    assert plan(2, 1) == {0: [(0, 0, 2 * HEAD, 2)], 1: [(0, 2 * HEAD, 2 * HEAD, 2)]}


def test_decode_tp_larger_reads_head_slices_of_prefill_blocks() -> None:
    assert plan(1, 2) == {0: [(0, 0, 2 * HEAD, 1), (1, 2 * HEAD, 2 * HEAD, 1)]}
    assert plan(2, 4) == {
        0: [(0, 0, HEAD, 1), (1, HEAD, HEAD, 1)],
        1: [(2, 0, HEAD, 1), (3, HEAD, HEAD, 1)],
    }


def writers_per_decode_rank(
    p: dict[int, list[tuple[int, int, int, int]]],
) -> dict[int, tuple[list[int], set[int]]]:
    """decode rank -> (prefill ranks writing into it, the expected_writers they carry)."""
    out: dict[int, tuple[list[int], set[int]]] = {}
    for r, targets in p.items():
        for d, _, _, writers in targets:
            ranks, counts = out.setdefault(d, ([], set()))
            ranks.append(r)
            counts.add(writers)
    return out


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads", "expected"),
    [
        # 1 KV head (or MLA's one latent): every rank holds it whole.
        (2, 2, 1, {0: [(0, 0, 0, 1)], 1: [(1, 0, 0, 1)]}),  # equal TP: rank to rank
        (2, 1, 1, {0: [(0, 0, 0, 1)], 1: []}),  # one replica writes, the other idles
        (1, 2, 1, {0: [(0, 0, 0, 1), (1, 0, 0, 1)]}),  # each decode rank gets it whole
        (2, 4, 1, {0: [(0, 0, 0, 1), (2, 0, 0, 1)], 1: [(1, 0, 0, 1), (3, 0, 0, 1)]}),
        (4, 2, 1, {0: [(0, 0, 0, 1)], 1: [(1, 0, 0, 1)], 2: [], 3: []}),
        # 2 KV heads, TP 4 prefill: heads 0, 0, 1, 1 on ranks 0-3.
        (4, 1, 2, {0: [(0, 0, HEAD, 2)], 1: [], 2: [(0, HEAD, HEAD, 2)], 3: []}),
        (4, 2, 2, {0: [(0, 0, 0, 1)], 1: [], 2: [], 3: [(1, 0, 0, 1)]}),
        # 2 KV heads, TP 4 decode: ranks 0, 1 hold head 0 and ranks 2, 3 head 1.
        (1, 4, 2, {0: [(0, 0, HEAD, 1), (1, 0, HEAD, 1), (2, HEAD, HEAD, 1), (3, HEAD, HEAD, 1)]}),
        (2, 4, 2, {0: [(0, 0, 0, 1), (1, 0, 0, 1)], 1: [(2, 0, 0, 1), (3, 0, 0, 1)]}),
    ],
)
def test_replicated_heads_one_replica_writes_each_decode_rank(
    p_tp: int, d_tp: int, heads: int, expected: dict[int, list[tuple[int, int, int, int]]]
) -> None:
    got = plan(p_tp, d_tp, heads=heads, total=heads)
    assert got == expected
    # Every decode rank is written, by as many prefill ranks as it expects.
    per_rank = writers_per_decode_rank(got)
    assert sorted(per_rank) == list(range(d_tp))
    for ranks, counts in per_rank.values():
        assert counts == {len(ranks)} and len(set(ranks)) == len(ranks)


@pytest.mark.parametrize(
    ("pe", "de", "why"),
    [
        (
            engine("P", Role.PREFILL, 3, heads=6),
            engine("D", Role.DECODE, 2, heads=6),
            "prefill TP 3 into decode TP 2: one TP size must divide the other",
        ),
        (
            engine("P", Role.PREFILL, 2, heads=1),  # TP 2 > 1 KV head: replicated
            engine("D", Role.DECODE, 1, heads=1),
            "KV heads are replicated across ranks (prefill 1 per rank, decode 1 per rank) "
            "and neither engine reports total_kv_heads",
        ),
        (
            engine("P", Role.PREFILL, 4, heads=8, total=2),  # 2 per rank, 2 in the model
            engine("D", Role.DECODE, 2, heads=2, total=2),
            "prefill reports 2 KV heads per rank; TP 4 of 2 KV heads gives 1",
        ),
        (
            engine("P", Role.PREFILL, 4, heads=4, total=6),
            engine("D", Role.DECODE, 2, heads=6, total=6),
            "prefill TP 4 does not divide the 6 KV heads",
        ),
        (
            engine("P", Role.PREFILL, 2, head_major=False),
            engine("D", Role.DECODE, 1, head_major=False),
            "needs a head-major KV block layout on both sides",
        ),
        (
            engine("P", Role.PREFILL, 1, compat=(("dtype", "bfloat16"),)),
            engine("D", Role.DECODE, 2),
            "dtype differs: prefill 'bfloat16', decode 'float32'",
        ),
        (
            engine("P", Role.PREFILL, 1, heads=1, compat=(*COMPAT, ("mla", "True"))),
            engine("D", Role.DECODE, 1, heads=1, compat=(*COMPAT, ("mla", "False"))),
            "mla differs: prefill 'True', decode 'False' (one engine's KV cache is MLA latents",
        ),
        (
            engine("P", Role.PREFILL, 2, regions=3),
            engine("D", Role.DECODE, 2),
            "KV regions differ in count or group",
        ),
        (
            engine("P", Role.PREFILL, 2, compat=(("model", "other"),)),
            engine("D", Role.DECODE, 2),
            "model differs",  # equal TP is checked the same way
        ),
    ],
)
def test_incompatible_pairs_are_refused_with_the_reason(
    pe: EngineRecord, de: EngineRecord, why: str
) -> None:
    assert why in mismatch(transfer(), pe, de)


def test_replication_without_head_counts_is_caught_by_block_lengths() -> None:
    """An agent that does not report its heads: equal block lengths at TP 2 -> 1
    mean each prefill rank holds every head (replicated or MLA)."""
    pe, de = engine("P", Role.PREFILL, 2, heads=1), engine("D", Role.DECODE, 1, heads=1)
    for e in (pe, de):
        for rec in e.ranks.values():
            layout = rec.reg.layout
            rec.reg = AgentRegistration(
                rec.reg.engine_id,
                rec.reg.role,
                rec.reg.tp_rank,
                rec.reg.tp_size,
                rec.reg.incarnation,
                rec.reg.nixl_agent_name,
                b"",
                KVLayout(16, layout.regions, compat=COMPAT, kv_heads=0, head_major=True),
            )
    assert "is not 2 x" in mismatch(transfer(), pe, de)


def hybrid_transfer(
    decode: tuple[tuple[int, ...], ...], prefill: tuple[tuple[int, ...], ...]
) -> Transfer:
    """A 100-token transfer (7 blocks of 16) with two KV cache groups."""
    t = Transfer(TransferId("t"), State.REGISTERED, 0.0, 0.0, 60.0, 0.0)
    t.decode = Side(EngineId("D"), of(*decode), 100)
    t.prefill = Side(EngineId("P"), of(*prefill), 100)
    return t


def test_sliding_window_group_pairs_the_same_token_positions() -> None:
    """vLLM's hybrid KV cache manager: group 1 is a sliding window, of which
    each side holds only the last blocks (a tail ending at the prompt's last
    block). Decode's blocks get the prefill blocks of the same positions;
    prefill blocks past the prompt are never written."""
    pe, de = engine("P", Role.PREFILL, 1), engine("D", Role.DECODE, 1)
    full_p, full_d = tuple(range(1, 9)), tuple(range(21, 28))  # prefill holds one extra block
    t = hybrid_transfer((full_d, (34, 35, 36)), (full_p, (11, 12, 13, 14)))
    assert mismatch(t, pe, de) == ""
    assert t.prefill is not None and t.decode is not None
    assert source_blocks(t.prefill, t.decode, 16) == (tuple(range(1, 8)), (12, 13, 14))
    # A decode prefix hit leaves it fewer blocks in either group: still the tail.
    t = hybrid_transfer(((26, 27), (36,)), (full_p, (11, 12, 13, 14)))
    assert t.prefill is not None and t.decode is not None
    assert source_blocks(t.prefill, t.decode, 16) == ((6, 7), (14,))


def test_decode_group_longer_than_the_prefill_window_is_refused() -> None:
    pe, de = engine("P", Role.PREFILL, 1), engine("D", Role.DECODE, 1)
    t = hybrid_transfer((tuple(range(21, 28)), (33, 34, 35, 36)), (tuple(range(1, 8)), (12, 13)))
    assert mismatch(t, pe, de) == (
        "KV group 1: prefill holds 2 of the prompt's last blocks, decode registered 4"
    )


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 2), (4, 2), (2, 4)])
def test_retained_transfers_share_their_writer_sets(ptp: int, dtp: int) -> None:
    """Each decode rank's sets of expected and arrived prefill ranks are the
    same in every transfer between the same engines: shared frozensets, not
    objects of each retained transfer (each is one more for a full GC pass,
    gcpolicy.py)."""
    from pushkv.controlplane.order_size import MAX_ORDER_BYTES
    from pushkv.controlplane.orders import OpenOrders, issue, record_arrivals

    pe, de = engine("P", Role.PREFILL, ptp), engine("D", Role.DECODE, dtp)
    ids = iter(range(1_000))
    done = []
    for _ in range(2):
        t = transfer()
        issue(
            t,
            pe,
            de,
            of((1, 2)),
            0.0,
            False,
            lambda: OrderId(f"o{next(ids)}"),
            OpenOrders(),
            MAX_ORDER_BYTES,
        )
        assert not t.all_arrived()
        for d, writers in sorted(t.expected.items()):
            first_half = sorted(writers)[: max(1, len(writers) // 2)]
            assert record_arrivals(t, d, first_half) == first_half
            assert record_arrivals(t, d, sorted(writers)) == sorted(set(writers) - set(first_half))
            assert record_arrivals(t, d, sorted(writers)) == []  # counted once
        assert t.all_arrived() and t.arrived_ranks() == set(range(ptp))
        done.append(t)
    a, b = done
    assert a.expected == b.expected and sorted(a.expected) == list(range(dtp))
    assert set().union(*a.expected.values()) == set(range(ptp))  # every prefill rank writes
    for d in a.expected:
        assert a.expected[d] is b.expected[d]
        assert a.arrived[d] is b.arrived[d] is a.expected[d]


def test_the_shared_rank_sets_are_bounded_and_still_correct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pushkv.controlplane import orders

    monkeypatch.setattr(orders, "_RANK_SETS", {})
    monkeypatch.setattr(orders, "_MAX_RANK_SETS", 2)
    a = orders.with_rank(None, 0)
    b = orders.with_rank(a, 1)
    c = orders.with_rank(b, 2)  # past the bound: a set of its own
    assert (a, b, c) == (frozenset({0}), frozenset({0, 1}), frozenset({0, 1, 2}))
    assert orders.with_rank(None, 0) is a and orders.with_rank(a, 1) is b
    assert orders.with_rank(b, 2) is not c and orders.with_rank(b, 2) == c
    assert len(orders._RANK_SETS) == 2
