"""Prepared descriptor lists: every block of one side's KV regions, handed to
NIXL once (``prep_xfer_dlist``) so that each WRITE names blocks by index
(``make_prepped_xfer``) instead of building, converting and resolving its
descriptors again.

That per-WRITE work cost about 1.5 µs per descriptor on the 2-core host (plan,
``get_xfer_descs`` twice, ``initialize_xfer``: 95 µs of a 64-block WRITE); on
a GPU, where each descriptor moves in a few µs, it was most of what the WRITE
spent beyond a memcpy of the same blocks (docs/benchmarks.md). NIXL merges
descriptors that are adjacent on both sides, as the planned path's runs did.

A table is one list per (side, byte range within each block): whole blocks,
or for a sliced WRITE (different TP sizes) the head range of each block. Row
``start[r] + b`` of a table is block ``b`` of region ``r``. Tables are made on
first use and released by their owner: the local ones by the endpoint before
it deregisters its memory, a peer's by the endpoint when it forgets the peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pushkv.agent.nixl_boundary import logged_if_nixl_fails, translate
from pushkv.agent.nixl_types import BlockSlice, FailureReason, NixlError
from pushkv.agent.write_plan import (
    Layout,
    check_range,
    duplicate_remote_ids,
    int_list,
    slice_offsets,
)

# The local side's name for prep_xfer_dlist.
LOCAL = "NIXL_INIT_AGENT"


class BlockTables:
    """The prepared lists of one side (ours, or one peer incarnation's)."""

    def __init__(self, agent: Any, owner: str, layout: Layout, mem_type: str) -> None:
        self._agent = agent
        self._owner = owner  # LOCAL, or the peer's agent name
        self._layout = layout
        self._mem_type = mem_type
        self._tables: dict[tuple[tuple[int, ...], int], Any] = {}
        starts = [0]
        for r in layout.regions[:-1]:
            starts.append(starts[-1] + r.num_blocks)
        self._starts = starts

    def get(self, offsets: tuple[int, ...], length: int) -> Any:
        """The list of ``length`` bytes at ``offsets[r]`` of every block of region
        ``r`` (``length`` 0: whole blocks)."""
        key = (offsets, length)
        handle = self._tables.get(key)
        if handle is None:
            handle = self._prep(offsets, length)
            self._tables[key] = handle
        return handle

    def indices(self, blocks: Sequence[int]) -> list[int]:
        """Rows of ``blocks`` in every region, region-major (as the planned rows)."""
        return [s + b for s in self._starts for b in blocks]

    def release(self) -> None:
        """Release every list (idempotent; a NIXL failure is only logged)."""
        tables, self._tables = self._tables, {}
        for handle in tables.values():
            with logged_if_nixl_fails(f"release a block list of {self._owner}"):
                self._agent.release_dlist_handle(handle)

    def _prep(self, offsets: tuple[int, ...], length: int) -> Any:
        # Nx5 rows (address, length, device, stride, count): each region's blocks
        # as one strided row, expanded by NIXL.
        rows = np.array(
            [
                (r.base_addr + off, length or r.block_len, r.device_id, r.block_len, r.num_blocks)
                for r, off in zip(self._layout.regions, offsets, strict=True)
                if r.num_blocks  # an empty region adds no rows (its start is the next's)
            ],
            dtype=np.uint64,
        ).reshape(-1, 5)
        try:
            return self._agent.prep_xfer_dlist(self._owner, rows, self._mem_type)
        except Exception as exc:
            what = "local" if self._owner == LOCAL else f"peer {self._owner!r}"
            raise translate(exc, f"prepare the {what} block list") from exc


class PreppedWrite:
    """What one WRITE names in the prepared lists, checked as the planned path
    checks it (write_plan.py): equal counts, ids in range, no remote id twice,
    a slice that fits every region."""

    __slots__ = (
        "local_blocks",
        "local_key",
        "nbytes",
        "num_descriptors",
        "remote_blocks",
        "remote_key",
    )

    def __init__(
        self,
        local: Layout,
        remote: Layout,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        remote_side: str,
        cut: BlockSlice | None,
    ) -> None:
        n = len(local_blocks)
        if n != len(remote_blocks):
            raise NixlError(
                FailureReason.INVALID_REQUEST,
                f"write to {remote_side}: {n} local blocks vs {len(remote_blocks)} remote blocks",
            )
        lb, rb = int_list(local_blocks), int_list(remote_blocks)
        self.local_blocks, self.remote_blocks = lb, rb
        regions = len(local.regions)
        zeros = tuple(0 for _ in range(regions))
        self.local_key, self.remote_key = (zeros, 0), (zeros, 0)
        self.num_descriptors = self.nbytes = 0
        if not n:  # nothing moves (the notification goes alone), as the planned path
            return
        check_range("local", min(lb), max(lb), local.max_blocks)
        check_range(remote_side, min(rb), max(rb), remote.max_blocks)
        if len(set(rb)) != n:
            raise duplicate_remote_ids(remote_side)
        if cut is None:
            if local.lens != remote.lens:
                raise NixlError(
                    FailureReason.INVALID_REQUEST,
                    f"write to {remote_side}: block lengths differ ({local.lens[0]} vs "
                    f"{remote.lens[0]} in region 0); only a sliced WRITE pairs them",
                )
            # What NIXL makes of them: adjacent blocks on both sides merge.
            self.num_descriptors = _runs(lb, rb) * regions
            self.nbytes = n * local.bytes_per_block
        else:
            offsets = slice_offsets(local, remote, remote_side, cut)
            self.local_key = (tuple(lo for lo, _ in offsets), cut.length)
            self.remote_key = (tuple(ro for _, ro in offsets), cut.length)
            self.num_descriptors = n * regions  # slices of adjacent blocks are not adjacent
            self.nbytes = self.num_descriptors * cut.length


def _runs(lb: list[int], rb: list[int]) -> int:
    """Runs of blocks consecutive on both sides (0 for no blocks)."""
    runs = 1 if lb else 0
    for i in range(1, len(lb)):
        if lb[i] != lb[i - 1] + 1 or rb[i] != rb[i - 1] + 1:
            runs += 1
    return runs
