"""Pipeline-parallel prefill in the coordinator's core and the pairing rule:
engine rank numbering and readiness (controlplane/registry.py), which decode
region each stage's region goes into and how many writers each decode rank
expects (controlplane/orders.py), and the pairing rule (pushkv/rules/pp_map.py,
pushkv/rules/pairing.py). Pure core, no processes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pushkv.controlplane.domain import AgentRegistration, EngineId, KVLayout, KVRegion, Role
from pushkv.controlplane.errors import FailedPrecondition, InvalidArgument
from pushkv.controlplane.orders import mismatch, rank_targets
from pushkv.controlplane.registry import EngineRecord, Registry
from pushkv.rules.block_groups import of
from pushkv.rules.pairing import KVShape, pair_mismatch
from pushkv.rules.pp_map import merge_stages, region_map
from tests.test_tp_orders import COMPAT, HEAD, transfer


def reg(
    eid: str, role: Role, tp_rank: int, tp: int, pp_rank: int, pp: int, layers: tuple[int, ...]
) -> AgentRegistration:
    per = 4 // tp
    layout = KVLayout(
        16,
        tuple(KVRegion(1 << (20 + i), per * HEAD, 64, layer=lay) for i, lay in enumerate(layers)),
        compat=COMPAT,
        kv_heads=per,
        head_major=True,
    )
    rank = pp_rank * tp + tp_rank
    return AgentRegistration(
        EngineId(eid), role, tp_rank, tp, f"inc{rank}", f"{eid}-{rank}", b"", layout,
        pp_rank=pp_rank, pp_size=pp,
    )  # fmt: skip


def engines(
    p_stages: Sequence[tuple[int, ...]], p_tp: int, d_stages: Sequence[tuple[int, ...]], d_tp: int
) -> tuple[EngineRecord, EngineRecord]:
    registry = Registry(lease_s=60)
    for eid, role, stages, tp in (
        ("P", Role.PREFILL, p_stages, p_tp),
        ("D", Role.DECODE, d_stages, d_tp),
    ):
        for s, layers in enumerate(stages):
            for t in range(tp):
                registry.hello(reg(eid, role, t, tp, s, len(stages), layers), 0.0)
    pe, de = registry.engine("P"), registry.engine("D")
    assert pe is not None and de is not None
    return pe, de


def test_ranks_are_numbered_stage_major_and_ready_with_every_stage() -> None:
    registry = Registry(lease_s=60)
    for s, t in ((0, 0), (0, 1), (1, 0)):
        registry.hello(reg("P", Role.PREFILL, t, 2, s, 2, (s,)), 0.0)
    eng = registry.engine("P")
    assert eng is not None
    # One comparison, so that the check of `ready` does not narrow it for mypy.
    assert (sorted(eng.ranks), eng.ready) == ([0, 1, 2], False)  # 3 of 2 x 2
    registry.hello(reg("P", Role.PREFILL, 1, 2, 1, 2, (1,)), 0.0)
    assert sorted(eng.ranks) == [0, 1, 2, 3] and eng.ready
    assert [eng.ranks[r].reg.pp_rank for r in range(4)] == [0, 0, 1, 1]
    assert eng.shape.pp_size == 2 and eng.shape.layers == (0, 1)


def test_stage_outside_or_other_pp_size_is_refused() -> None:
    registry = Registry(lease_s=60)
    with pytest.raises(InvalidArgument, match="pp_rank 2 outside pp_size 2"):
        registry.hello(reg("P", Role.PREFILL, 0, 1, 2, 2, (0,)), 0.0)
    registry.hello(reg("P", Role.PREFILL, 0, 1, 0, 2, (0,)), 0.0)
    with pytest.raises(FailedPrecondition, match="registered with pp_size 2"):
        registry.hello(reg("P", Role.PREFILL, 0, 1, 0, 3, (0,)), 0.0)


SPLIT = [(0, 1), (2, 3, 4)]
ALL = [(0, 1, 2, 3, 4)]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_each_stage_writes_its_layers_regions(p_tp: int, d_tp: int) -> None:
    pe, de = engines(SPLIT, p_tp, [(4, 3, 2, 1, 0)], d_tp)  # decode regions reversed
    assert mismatch(transfer(), pe, de) == ""
    per_d: dict[int, set[int]] = {}
    for rank in range(2 * p_tp):
        targets = rank_targets(pe, de, rank, of((1, 2)), of((5, 6)))
        stage = rank // p_tp
        want = (4, 3) if stage == 0 else (2, 1, 0)  # layer -> decode region 4 - layer
        tp_writers = max(1, p_tp // d_tp)
        for t in targets:
            assert t.dst_regions == want
            assert t.expected_writers == tp_writers * 2  # every stage writes
            per_d.setdefault(t.decode_rank, set()).add(rank)
    # Each decode rank expects as many writers as it is told.
    for d, writers in per_d.items():
        assert len(writers) == max(1, p_tp // d_tp) * 2, (d, writers)


def test_without_pp_no_region_map() -> None:
    pe, de = engines(ALL, 1, ALL, 1)
    (t,) = rank_targets(pe, de, 0, of((1,)), of((5,)))
    assert t.dst_regions == () and t.expected_writers == 1


@pytest.mark.parametrize(
    ("p_stages", "d_stages", "why"),
    [
        ([(0, 1), (2, 3)], ALL, "missing [4]"),
        ([(0, 1), (1, 2, 3, 4)], ALL, "more regions than decode: [1]"),
        ([(0, 1), (2, 3, 4, 5)], ALL, "extra [5]"),
        (SPLIT, SPLIT, "decode pipeline parallelism (PP 2) is not supported"),
        (SPLIT, [(-1, -1, -1, -1, -1)], "the decode engine does not report every KV region's"),
        ([(-1, -1), (-1, -1, -1)], ALL, "the prefill engine does not report every KV region's"),
    ],
)
def test_pipelines_that_do_not_pair_are_refused(
    p_stages: list[tuple[int, ...]], d_stages: list[tuple[int, ...]], why: str
) -> None:
    pe, de = engines(p_stages, 1, d_stages, 1)
    problem = mismatch(transfer(), pe, de)
    assert why in problem, problem


def test_router_rule_reads_the_merged_shape() -> None:
    """The shape ListEngines shows (every stage's regions) pairs as the
    coordinator pairs; a stage's own shape alone would not."""
    stage = [KVShape(16, regions=((0, 8),) * n, layers=ls) for n, ls in ((2, (0, 1)), (1, (2,)))]
    merged = merge_stages(stage)
    decode = KVShape(16, regions=((0, 8),) * 3, layers=(0, 1, 2))
    assert pair_mismatch(1, merged, 1, decode) == ""
    assert "KV regions differ in count" in pair_mismatch(1, stage[0], 1, decode)


def test_region_map_pairs_the_kth_region_of_a_layer() -> None:
    assert region_map([3, 3, 5], [5, 3, 4, 3]) == (1, 3, 0)
    with pytest.raises(ValueError, match="layer 7"):
        region_map([7], [1, 2])
