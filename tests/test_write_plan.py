"""Tests of agent.write_plan, the pure WRITE planner: no NIXL endpoint, no process.

Descriptor rows are (addr, nbytes, device_id), region-major; the Python and the
vectorized paths must give the same rows for the same ids.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pushkv.agent import write_plan
from pushkv.agent.nixl_types import BlockSlice, FailureReason, KVRegion, NixlError, PeerKey
from pushkv.agent.write_plan import Layout, check_pairing, merge_runs, plan_sliced_write, plan_write

ROOT = Path(__file__).resolve().parent.parent


def test_planner_loads_without_nixl() -> None:
    """The planner and its value types import neither NIXL nor the NIXL boundary."""
    code = (
        "import sys, pushkv.agent.write_plan; print(sorted(m for m in sys.modules"
        " if m.split('.')[0].startswith('nixl') or m == 'pushkv.agent.nixl_adapter'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_merge_runs_contiguous() -> None:
    assert merge_runs([4, 5, 6, 7], [10, 11, 12, 13]) == [(4, 10, 4)]


def test_merge_runs_scattered() -> None:
    assert merge_runs([1, 5, 3], [9, 2, 7]) == [(1, 9, 1), (5, 2, 1), (3, 7, 1)]


def test_merge_runs_mixed() -> None:
    local = [0, 1, 2, 5, 9, 10, 11]
    remote = [3, 4, 5, 20, 7, 8, 12]  # last pair is consecutive locally only
    assert merge_runs(local, remote) == [(0, 3, 3), (5, 20, 1), (9, 7, 2), (11, 12, 1)]


def test_merge_runs_consecutive_on_one_side_only_splits() -> None:
    assert merge_runs([0, 1, 2], [5, 7, 8]) == [(0, 5, 1), (1, 7, 2)]
    assert merge_runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]


def test_merge_runs_empty() -> None:
    assert merge_runs([], []) == []


def test_merge_runs_length_mismatch() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        merge_runs([1, 2], [1])


def _rows(rows: object) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in row) for row in rows]  # type: ignore[attr-defined]


def _shuffled_chunks(n: int, base: int, chunk: int, rng: np.random.Generator) -> list[int]:
    """ids base..base+n-1, cut into consecutive chunks, chunks in random order."""
    chunks = [range(base + i, base + min(i + chunk, n)) for i in range(0, n, chunk)]
    return [b for i in rng.permutation(len(chunks)) for b in chunks[i]]


def test_plan_vectorized_path_matches_python_path() -> None:
    local = Layout.of([KVRegion(1 << 20, 4096, 64), KVRegion(1 << 30, 512, 70)], "local")
    remote = Layout.of([KVRegion(1 << 21, 4096, 100), KVRegion(1 << 31, 512, 90)], "remote")
    rng = np.random.default_rng(7)
    for n in (1, 3, 17, 40, 64):
        lb = _shuffled_chunks(n, 0, 4, rng)  # different chunking on each side:
        rb = _shuffled_chunks(n, 3, 3, rng)  # runs merge only partially
        py = plan_write(local, remote, lb, rb, "peer", vector_min=10**9)
        vec = plan_write(local, remote, lb, rb, "peer", vector_min=1)
        runs = merge_runs(lb, rb)
        assert py.num_descriptors == vec.num_descriptors == 2 * len(runs)
        assert py.nbytes == vec.nbytes == n * (4096 + 512)
        assert _rows(py.local_rows) == _rows(vec.local_rows)
        assert _rows(py.remote_rows) == _rows(vec.remote_rows)
        first = runs[0]
        assert _rows(py.local_rows)[0] == ((1 << 20) + first[0] * 4096, first[2] * 4096, 0)
        assert _rows(py.remote_rows)[len(runs)] == ((1 << 31) + first[1] * 512, first[2] * 512, 0)


@pytest.mark.parametrize("vector_min", [1, 10**9])
def test_plan_rejects_bad_ids_on_both_paths(vector_min: int) -> None:
    layout = Layout.of([KVRegion(4096, 64, 32)], "x")
    n = 20
    ok = list(range(n))
    cases = [
        (ok, ok[:-1], "vs"),
        ([*ok[:-1], 32], ok, "local block id 32 out of range"),
        (ok, [-1, *ok[1:]], "peer block id -1 out of range"),
        (ok, [0, *ok[:-1]], "duplicate remote block ids"),
        # one run on both sides (the contiguous fast path), running off either end
        (list(range(13, 13 + n)), ok, "local block id 32 out of range"),
        (ok, list(range(-1, n - 1)), "peer block id -1 out of range"),
    ]
    for lb, rb, match in cases:
        with pytest.raises(NixlError, match=match) as info:
            plan_write(layout, layout, lb, rb, "peer", vector_min=vector_min)
        assert info.value.reason is FailureReason.INVALID_REQUEST
    assert plan_write(layout, layout, [], [], "peer").num_descriptors == 0


@pytest.mark.parametrize("kind", ["list", "tuple", "ndarray", "range"])
def test_plan_contiguous_fast_path_accepts_any_sequence(kind: str) -> None:
    convert: dict[str, Callable[[Sequence[int]], Any]] = {
        "list": list,
        "tuple": tuple,
        "ndarray": np.array,
        "range": lambda ids: ids if isinstance(ids, range) else list(ids),
    }
    as_kind = convert[kind]
    local = Layout.of([KVRegion(1 << 20, 4096, 300), KVRegion(1 << 30, 512, 300)], "local")
    remote = Layout.of([KVRegion(1 << 21, 4096, 300), KVRegion(1 << 31, 512, 300)], "remote")
    for n in (1, 2, 64, 256):
        plan = plan_write(
            local, remote, as_kind(range(5, 5 + n)), as_kind(range(40, 40 + n)), "peer"
        )
        assert plan.num_descriptors == 2 and plan.nbytes == n * (4096 + 512)
        assert _rows(plan.local_rows) == [
            ((1 << 20) + 5 * 4096, n * 4096, 0),
            ((1 << 30) + 5 * 512, n * 512, 0),
        ]
        assert _rows(plan.remote_rows)[1] == ((1 << 31) + 40 * 512, n * 512, 0)
    # consecutive on one side only: no merge, one descriptor per block and region
    plan = plan_write(local, remote, as_kind(range(64)), as_kind(range(63, -1, -1)), "peer")
    assert plan.num_descriptors == 128
    scattered = np.random.default_rng(3).permutation(256).tolist()
    for vector_min in (1, 10**9):
        plan = plan_write(
            local, remote, as_kind(scattered), as_kind(range(256)), "peer", vector_min=vector_min
        )
        assert plan.num_descriptors == 2 * len(merge_runs(scattered, range(256)))


def test_layout_rejects_missing_or_invalid_regions() -> None:
    with pytest.raises(NixlError, match="no KV regions") as info:
        Layout.of([], "local")
    assert info.value.reason is FailureReason.INVALID_REQUEST
    for bad in (KVRegion(0, 64, 4), KVRegion(4096, 0, 4), KVRegion(4096, 64, -1)):
        with pytest.raises(NixlError, match="region 1 is invalid") as info:
            Layout.of([KVRegion(4096, 64, 4), bad], "local")
        assert info.value.reason is FailureReason.INVALID_REQUEST


def test_layout_bounds_ids_by_its_smallest_region() -> None:
    layout = Layout.of([KVRegion(1 << 20, 64, 10), KVRegion(1 << 30, 32, 6)], "local")
    assert layout.max_blocks == 6 and layout.bytes_per_block == 96
    plan_write(layout, layout, [5], [5], "peer")
    with pytest.raises(NixlError, match="local block id 6 out of range"):
        plan_write(layout, layout, [6], [0], "peer")


def test_check_pairing_pairs_regions_by_index() -> None:
    peer = PeerKey("decode-0", "1")
    two = Layout.of([KVRegion(1 << 20, 64, 8), KVRegion(1 << 30, 32, 8)], "local")
    check_pairing(two, Layout.of([KVRegion(1 << 21, 64, 4), KVRegion(1 << 31, 32, 4)], "p"), peer)
    with pytest.raises(NixlError, match="has 1 KV regions, local has 2"):
        check_pairing(two, Layout.of([KVRegion(1 << 21, 64, 8)], "p"), peer)
    swapped = Layout.of([KVRegion(1 << 21, 32, 8), KVRegion(1 << 31, 64, 8)], "p")
    with pytest.raises(NixlError, match="region 1 has block_len 64") as info:
        check_pairing(two, swapped, peer)
    assert info.value.reason is FailureReason.INVALID_REQUEST
    # Engines of different TP sizes: every region in the same ratio.
    check_pairing(two, Layout.of([KVRegion(1 << 21, 128, 4), KVRegion(1 << 31, 64, 4)], "p"), peer)
    with pytest.raises(NixlError, match="region 1 has block_len 48"):
        check_pairing(
            two, Layout.of([KVRegion(1 << 21, 128, 4), KVRegion(1 << 31, 48, 4)], "p"), peer
        )


def test_whole_block_write_refuses_other_block_lengths() -> None:
    local = Layout.of([KVRegion(1 << 20, 64, 8)], "local")
    remote = Layout.of([KVRegion(1 << 21, 128, 8)], "remote")
    with pytest.raises(NixlError, match="block lengths differ"):
        plan_write(local, remote, [1], [2], "peer")


@pytest.mark.parametrize("py_rows_max", [64, 0])  # tuple rows and the Nx3 array
def test_sliced_write_rows(monkeypatch: pytest.MonkeyPatch, py_rows_max: int) -> None:
    """A head slice per block: the larger side contributes [offset, +len) of each
    block, the other whole blocks; one descriptor per block and region."""
    monkeypatch.setattr(write_plan, "PY_ROWS_MAX", py_rows_max)
    small = Layout.of([KVRegion(1 << 20, 100, 8), KVRegion(1 << 30, 100, 8)], "p")
    large = Layout.of([KVRegion(1 << 21, 300, 8), KVRegion(1 << 31, 300, 8)], "d")
    cut = BlockSlice(200, 100)
    plan = plan_sliced_write(small, large, [1, 2, 3], [5, 6, 0], "d", cut)
    rows = [tuple(int(x) for x in r) for r in plan.local_rows]
    assert rows == [((1 << 20) + b * 100, 100, 0) for b in (1, 2, 3)] + [
        ((1 << 30) + b * 100, 100, 0) for b in (1, 2, 3)
    ]
    rows = [tuple(int(x) for x in r) for r in plan.remote_rows]
    assert rows == [((1 << 21) + b * 300 + 200, 100, 0) for b in (5, 6, 0)] + [
        ((1 << 31) + b * 300 + 200, 100, 0) for b in (5, 6, 0)
    ]
    assert (plan.num_descriptors, plan.nbytes) == (6, 600)
    # The other direction: the slice is taken from the local (larger) blocks.
    plan = plan_sliced_write(large, small, [4], [7], "p", BlockSlice(100, 100))
    local_rows = [tuple(int(x) for x in r) for r in plan.local_rows]
    remote_rows = [tuple(int(x) for x in r) for r in plan.remote_rows]
    assert local_rows[:1] == [((1 << 21) + 4 * 300 + 100, 100, 0)]
    assert remote_rows[:1] == [((1 << 20) + 7 * 100, 100, 0)]


@pytest.mark.parametrize(
    ("cut", "blocks", "match"),
    [
        (BlockSlice(250, 100), [5], "does not fit"),  # past the block's end
        (BlockSlice(0, 50), [5], "does not fit"),  # not the smaller block's length
        (BlockSlice(0, 100), [8], "out of range"),
        (BlockSlice(0, 100), [5, 5], "duplicate remote"),
    ],
)
def test_sliced_write_refuses_what_does_not_fit(
    cut: BlockSlice, blocks: list[int], match: str
) -> None:
    small = Layout.of([KVRegion(1 << 20, 100, 8)], "p")
    large = Layout.of([KVRegion(1 << 21, 300, 8)], "d")
    with pytest.raises(NixlError, match=match):
        plan_sliced_write(small, large, list(range(len(blocks))), blocks, "d", cut)


def test_descriptor_arrays_match_tuple_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PY_ROWS_MAX descriptors the Python pass gives an Nx3 uint64 array, same values."""
    local = Layout.of([KVRegion(1 << 20, 4096, 64), KVRegion(1 << 30, 512, 64)], "local")
    remote = Layout.of([KVRegion(1 << 21, 4096, 64), KVRegion(1 << 31, 512, 64)], "remote")
    lb, rb = [0, 1, 2, 9, 4], [7, 8, 9, 3, 30]  # runs (0,7,3) (9,3,1) (4,30,1)
    tuples = plan_write(local, remote, lb, rb, "peer")
    assert isinstance(tuples.local_rows, list)
    monkeypatch.setattr("pushkv.agent.write_plan.PY_ROWS_MAX", 0)
    arrays = plan_write(local, remote, lb, rb, "peer")
    assert isinstance(arrays.local_rows, np.ndarray) and arrays.local_rows.dtype == np.uint64
    assert _rows(arrays.local_rows) == _rows(tuples.local_rows)
    assert _rows(arrays.remote_rows) == _rows(tuples.remote_rows)
    assert _rows(tuples.remote_rows) == [
        ((1 << 21) + 7 * 4096, 3 * 4096, 0),
        ((1 << 21) + 3 * 4096, 4096, 0),
        ((1 << 21) + 30 * 4096, 4096, 0),
        ((1 << 31) + 7 * 512, 3 * 512, 0),
        ((1 << 31) + 3 * 512, 512, 0),
        ((1 << 31) + 30 * 512, 512, 0),
    ]
    assert arrays.num_descriptors == tuples.num_descriptors == 6
    assert arrays.nbytes == tuples.nbytes == 5 * (4096 + 512)


def test_pick_pairs_a_stage_with_the_peer_regions_of_its_layers() -> None:
    """A pipeline-parallel stage (2 regions) writes into regions 2 and 0 of a
    3-region peer: the WRITE's remote rows are those regions' blocks, in the
    stage's region order; repeated or out-of-range regions are refused."""
    local = Layout.of([KVRegion(1 << 20, 256, 8), KVRegion(1 << 21, 256, 8)], "stage")
    peer = Layout.of([KVRegion((i + 1) << 24, 256, 8) for i in range(3)], "peer")
    plan = write_plan.plan_write(local, peer.pick((2, 0), "peer"), [1], [5], "peer")
    assert [row[0] for row in plan.remote_rows] == [(3 << 24) + 5 * 256, (1 << 24) + 5 * 256]
    for bad in ((0, 0), (0, 3)):
        with pytest.raises(NixlError, match="not distinct regions of its 3") as info:
            peer.pick(bad, "peer")
        assert info.value.reason is FailureReason.INVALID_REQUEST
