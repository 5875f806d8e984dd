"""``pushkv bench dataplane --sliced``: head-slice WRITEs between engines of
different TP sizes against memcpy of the same bytes, in the same run.

For each block size B (the larger side's block: one decode block at TP1, one
prefill block at TP1) and count, alternately, as pushkv/bench/dataplane.py does:

* ``2->1``: the initiator is prefill rank 1 of TP2 (blocks of B/2 bytes); each
  block lands whole at offset B/2 of a target block of B bytes (decode TP1).
* ``1->2``: the initiator is prefill TP1 (blocks of B); bytes [B/2, B) of each
  block land as a whole target block of B/2 (decode rank 1 of TP2).

Both are ``NixlEndpoint.post_write(..., block_slice=...)``, as the agents post
them (``agent/write_plan.py`` ``plan_sliced_write``: one descriptor per block
and region). memcpy is a copy of the same slices in-process, one copy
per block and region (``np.copyto``; with ``--memory vram``
``cuMemcpyDtoDAsync`` each, then one synchronisation: pushkv/bench/dataplane_memory.py).
After each direction one scattered sliced WRITE with a notification is
verified by the target (every byte of each slice, and for 2->1 the other half
of the block still holding the target's fill).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from pushkv.agent.nixl_adapter import NixlEndpoint
from pushkv.agent.nixl_types import BlockSlice, KVRegion, PeerKey
from pushkv.bench.dataplane import KiB, Row, _Bench, _time_kernel, _wait
from pushkv.bench.dataplane_memory import CudaMemory, Memory, Pool
from pushkv.bench.dataplane_target import FILL

DIRECTIONS = ("2->1", "1->2")


def run_sliced(bench: _Bench, block_len: int, counts: Sequence[int]) -> list[Row]:
    rows: list[Row] = []
    for direction in DIRECTIONS:
        rows += _direction(bench, block_len, counts, direction)
    return rows


def _direction(bench: _Bench, big: int, counts: Sequence[int], direction: str) -> list[Row]:
    half = big // 2
    local_len, remote_len = (half, big) if direction == "2->1" else (big, half)
    cut = BlockSlice(half, half)  # rank 1's heads: the second half of the larger block
    pool_blocks = 2 * max(counts)
    regions = bench.args.regions
    tag = f"{big // KiB}k-{direction.replace('->', 'to')}"
    mem = bench.mem
    bench.conn.send(
        ("setup", f"bench-target-{tag}", remote_len, pool_blocks, regions, bench.args.memory)
    )
    src = [mem.pattern(pool_blocks, local_len) for _ in range(regions)]
    dst = [mem.pool(pool_blocks, remote_len, FILL) for _ in range(regions)]
    rows: list[Row] = []
    with NixlEndpoint(f"bench-init-{tag}", memory=mem.kind) as ep:
        ep.register_kv([KVRegion(mem.addr(p), local_len, pool_blocks, mem.device_id) for p in src])
        _, md, layout, _pid = bench._recv("ready")
        peer = PeerKey(f"bench-target-{tag}", "0")
        ep.add_peer(peer, md, [KVRegion(a, bl, n, mem.device_id) for a, bl, n in layout])
        for count in counts:
            for layout_name in ("scattered", "contiguous"):
                rows.append(_measure(bench, ep, peer, src, dst, count, layout_name, direction, cut))
        _verify(bench, ep, peer, pool_blocks, min(8, pool_blocks // 2), direction, cut)
    return rows


def _measure(
    bench: _Bench,
    ep: NixlEndpoint,
    peer: PeerKey,
    src: Sequence[Pool],
    dst: Sequence[Pool],
    count: int,
    layout: str,
    direction: str,
    cut: BlockSlice,
) -> Row:
    pool_blocks = src[0].shape[0]
    nbytes = count * cut.length * len(src)
    reps = bench._reps(nbytes)
    writes: list[float] = []
    copies: list[float] = []
    kernels: list[float] = []
    descs: list[int] = []
    sl, dl = src[0].shape[1], dst[0].shape[1]
    off, end = cut.offset, cut.offset + cut.length
    # The columns each block's bytes come from and land in.
    dst_cols, src_cols = ((off, end), (0, sl)) if direction == "2->1" else ((0, dl), (off, end))
    for rep in range(reps + 2):  # two warm-up repetitions
        local, remote = bench._pattern(pool_blocks, count, layout)
        if rep % 2 == 0:
            w, d = _time_write(ep, peer, local, remote, cut)
            c = _time_memcpy(bench.mem, src, dst, local, remote, direction, cut)
        else:
            c = _time_memcpy(bench.mem, src, dst, local, remote, direction, cut)
            w, d = _time_write(ep, peer, local, remote, cut)
        if rep >= 2:
            writes.append(w)
            copies.append(c)
            descs.append(d)
            if isinstance(bench.mem, CudaMemory):
                k = _time_kernel(bench.mem, src, dst, remote, local, dst_cols, src_cols)
                kernels.append(k)
    big = max(src[0].shape[1], dst[0].shape[1])
    return Row(
        blocks=count,
        block_len=big,
        layout=f"{direction} {layout[:4]}",
        descs=int(statistics.median(descs)),
        write_us=statistics.median(writes) * 1e6,
        memcpy_us=statistics.median(copies) * 1e6,
        nbytes=nbytes,
        kernel_us=statistics.median(kernels) * 1e6 if kernels else None,
    )


def _time_write(
    ep: NixlEndpoint, peer: PeerKey, local: list[int], remote: list[int], cut: BlockSlice
) -> tuple[float, int]:
    t0 = time.perf_counter()
    handle = ep.post_write(peer, local, remote, block_slice=cut)
    _wait(ep, handle)
    elapsed = time.perf_counter() - t0
    ep.release(handle)
    return elapsed, handle.num_descriptors


def _time_memcpy(
    mem: Memory,
    src: Sequence[Pool],
    dst: Sequence[Pool],
    local: list[int],
    remote: list[int],
    direction: str,
    cut: BlockSlice,
) -> float:
    sl, dl = src[0].shape[1], dst[0].shape[1]
    off, n = cut.offset, cut.length
    t0 = time.perf_counter()
    if direction == "2->1":  # a whole local block into [off, off + n) of the remote one
        spans = [(rb * dl + off, lb * sl, n) for lb, rb in zip(local, remote, strict=True)]
    else:  # [off, off + n) of the local block as a whole remote block
        spans = [(rb * dl, lb * sl + off, n) for lb, rb in zip(local, remote, strict=True)]
    for s, d in zip(src, dst, strict=True):
        mem.copy_runs(d, s, spans)
    mem.done()
    return time.perf_counter() - t0


def _verify(
    bench: _Bench,
    ep: NixlEndpoint,
    peer: PeerKey,
    pool_blocks: int,
    count: int,
    direction: str,
    cut: BlockSlice,
) -> None:
    local, remote = bench._pattern(pool_blocks, count, "scattered")
    notif = f"bench-verify-{direction}".encode()
    handle = ep.post_write(peer, local, remote, notif, block_slice=cut)
    _wait(ep, handle)
    ep.release(handle)
    # 2->1: the slice sits at cut.offset of the target's block; 1->2: it is the whole block.
    span = (cut.offset, cut.length) if direction == "2->1" else None
    bench.conn.send(("verify", list(zip(remote, local, strict=True)), notif, span))
    result = bench._recv("verified")[1]
    if result != "ok":
        raise RuntimeError(f"target verification failed ({direction}): {result}")
