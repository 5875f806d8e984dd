"""The coordinator's TP mapping (controlplane/orders.py): which decode rank each
prefill rank writes, at which byte slice, how many writers each decode rank
expects, and which pairs are refused and why. Pure core, no processes."""

from __future__ import annotations

import pytest

from controlplane.domain import AgentRegistration, EngineId, KVLayout, KVRegion, Role
from controlplane.orders import mismatch, rank_targets
from controlplane.registry import AgentRecord, EngineRecord
from controlplane.transfer import Side, State, Transfer

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
) -> EngineRecord:
    per = max(1, heads // tp)
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
    t = Transfer("t", State.REGISTERED, 0.0, 0.0, 60.0, 0.0)  # type: ignore[arg-type]
    t.decode = Side(EngineId("D"), ((5, 6),), 20)
    t.prefill = Side(EngineId("P"), ((1, 2),), 20)
    return t


def plan(p_tp: int, d_tp: int) -> dict[int, list[tuple[int, int, int, int]]]:
    """prefill rank -> [(decode rank, slice offset, slice len, expected writers)]."""
    pe, de = engine("P", Role.PREFILL, p_tp), engine("D", Role.DECODE, d_tp)
    assert mismatch(transfer(), pe, de) == ""
    out = {}
    for r in range(p_tp):
        targets = rank_targets(pe, de, r, ((1, 2),), ((5, 6),))
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
            "KV heads are replicated across ranks",
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
