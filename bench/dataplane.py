"""``pushkv bench dataplane``: NIXL WRITE vs in-process numpy memcpy, same block patterns.

One run spawns a target process and, for each block size (16 KiB, 128 KiB, 1 MiB)
and block count (1, 8, 64, 256; combos above ``--max-mib`` skipped), measures
alternately:

* WRITE: ``NixlEndpoint.post_write`` -> DONE as seen by the initiator (includes
  building the request; no notification; handle released outside the timing);
* memcpy: ``np.copyto`` of the same blocks with the same pattern in-process, one
  copy per merged run (the same runs NIXL gets as descriptors).

* with ``--cma-floor``, also the kernel floor of that WRITE: the same bytes
  moved into the target by ``process_vm_writev`` called directly (ctypes), ONE
  call carrying every run as an iovec.  UCX's CMA transport makes one such
  call per descriptor (per 512 KiB segment), so WRITE time minus this floor is
  what NIXL, UCX and the per-descriptor system calls add.

"scattered" draws fresh random distinct block ids on BOTH sides per repetition
(so runs rarely merge); "contiguous" writes blocks [s, s+n) to [t, t+n).  All
buffers are pre-touched.  After each block size one scattered WRITE with a
notification is verified byte-for-byte by the target.  Single host only: it
sets ``UCX_NET_DEVICES=lo`` unless already set.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.nixl_adapter import NixlEndpoint, quiet_nixl_env
from agent.nixl_types import KVRegion, PeerKey, TransferState, WriteHandle
from agent.write_plan import merge_runs

KiB = 1024
MiB = 1024 * KiB
BLOCK_SIZES = (16 * KiB, 128 * KiB, 1 * MiB)
BLOCK_COUNTS = (1, 8, 64, 256)
QUICK_COUNTS = (1, 8, 64)
GOAL = (64, 128 * KiB)
WAIT_S = 30.0
FILL = 0xEE

_U8 = npt.NDArray[np.uint8]


def _fill_pattern(pool: _U8) -> None:
    """Block b of the pool holds the byte b % 251 (pre-touches every page)."""
    pool[:] = (np.arange(pool.shape[0], dtype=np.uint32) % 251).astype(np.uint8)[:, None]


# --------------------------------------------------------------------------- target process


def _target_main(conn: Connection) -> None:
    """Target: (re)creates a registered pool on "setup", verifies on "verify"."""
    for key, value in quiet_nixl_env(loopback=True).items():
        os.environ.setdefault(key, value)
    ep: NixlEndpoint | None = None
    pools: list[_U8] = []
    try:
        while conn.poll(600.0):
            try:
                cmd: tuple[Any, ...] = conn.recv()
            except EOFError:
                return
            if cmd[0] == "setup":
                _, name, block_len, num_blocks, num_regions = cmd
                if ep is not None:
                    ep.close()
                pools = [np.full((num_blocks, block_len), FILL, np.uint8)]
                pools += [np.full_like(pools[0], FILL) for _ in range(num_regions - 1)]
                ep = NixlEndpoint(name)
                ep.register_kv([KVRegion(p.ctypes.data, block_len, num_blocks) for p in pools])
                layout = [(r.base_addr, r.block_len, r.num_blocks) for r in ep.regions]
                conn.send(("ready", ep.metadata(), layout, os.getpid()))
            elif cmd[0] == "verify" and ep is not None:
                _, pairs, notif = cmd
                conn.send(("verified", _verify_target(ep, pools, pairs, notif)))
            elif cmd[0] == "exit":
                return
    finally:
        if ep is not None:
            ep.close()


def _verify_target(
    ep: NixlEndpoint, pools: Sequence[_U8], pairs: Sequence[tuple[int, int]], notif: bytes
) -> str:
    deadline = time.monotonic() + WAIT_S
    seen: list[tuple[str, bytes]] = []
    while not any(msg == notif for _, msg in seen):
        if time.monotonic() > deadline:
            return f"notification {notif!r} not received within {WAIT_S} s"
        seen += ep.get_notifications()
    for pool in pools:
        for remote, local in pairs:
            if not np.all(pool[remote] == local % 251):
                return f"remote block {remote} does not hold local block {local}"
    return "ok"


# --------------------------------------------------------------------------- initiator


@dataclass(frozen=True, slots=True)
class Row:
    blocks: int
    block_len: int
    layout: str
    descs: int
    write_us: float
    memcpy_us: float
    nbytes: int
    floor_us: float | None = None

    @property
    def write_gbps(self) -> float:
        return self.nbytes / (self.write_us * 1e3)

    @property
    def memcpy_gbps(self) -> float:
        return self.nbytes / (self.memcpy_us * 1e3)

    @property
    def ratio(self) -> float:
        return self.write_gbps / self.memcpy_gbps

    @property
    def floor_ratio(self) -> float | None:
        return None if self.floor_us is None else self.memcpy_us / self.floor_us


class _Bench:
    def __init__(self, conn: Connection, args: argparse.Namespace) -> None:
        self.conn = conn
        self.args = args
        self.rng = np.random.default_rng(args.seed)

    def _recv(self, tag: str) -> tuple[Any, ...]:
        if not self.conn.poll(WAIT_S * 4):
            raise TimeoutError(f"target sent no {tag!r} within {WAIT_S * 4} s")
        msg: tuple[Any, ...] = self.conn.recv()
        if msg[0] != tag:
            raise RuntimeError(f"target: expected {tag!r}, got {msg!r}")
        return msg

    def run_size(self, block_len: int, counts: Sequence[int]) -> list[Row]:
        pool_blocks = 2 * max(counts)
        regions = self.args.regions
        tag = f"{block_len // KiB}k-{os.getpid()}"
        self.conn.send(("setup", f"bench-target-{tag}", block_len, pool_blocks, regions))
        src = [np.empty((pool_blocks, block_len), np.uint8) for _ in range(regions)]
        dst = [np.full((pool_blocks, block_len), FILL, np.uint8) for _ in range(regions)]
        for pool in src:
            _fill_pattern(pool)
        rows: list[Row] = []
        with NixlEndpoint(f"bench-init-{tag}") as ep:
            ep.register_kv([KVRegion(p.ctypes.data, block_len, pool_blocks) for p in src])
            _, md, layout, pid = self._recv("ready")
            peer = PeerKey(f"bench-target-{tag}", "0")
            ep.add_peer(peer, md, [KVRegion(a, bl, n) for a, bl, n in layout])
            floor = _CmaFloor(pid, src, [a for a, _, _ in layout]) if self.args.cma_floor else None
            for count in counts:
                for layout_name in ("scattered", "contiguous"):
                    rows.append(self._measure(ep, peer, src, dst, count, layout_name, floor))
            self._verify(ep, peer, pool_blocks, min(8, pool_blocks // 2))
        return rows

    def _pattern(self, pool_blocks: int, count: int, layout: str) -> tuple[list[int], list[int]]:
        if layout == "scattered":
            local = self.rng.choice(pool_blocks, size=count, replace=False)
            remote = self.rng.choice(pool_blocks, size=count, replace=False)
            return [int(b) for b in local], [int(b) for b in remote]
        ls, rs = (int(x) for x in self.rng.integers(0, pool_blocks - count + 1, size=2))
        return list(range(ls, ls + count)), list(range(rs, rs + count))

    def _reps(self, nbytes: int) -> int:
        if self.args.reps:
            return int(self.args.reps)
        budget, lo, hi = (128 * MiB, 5, 40) if self.args.quick else (1024 * MiB, 9, 200)
        return max(lo, min(hi, budget // nbytes))

    def _measure(
        self,
        ep: NixlEndpoint,
        peer: PeerKey,
        src: Sequence[_U8],
        dst: Sequence[_U8],
        count: int,
        layout: str,
        floor: _CmaFloor | None = None,
    ) -> Row:
        pool_blocks, block_len = src[0].shape
        nbytes = count * block_len * len(src)
        reps = self._reps(nbytes)
        writes: list[float] = []
        copies: list[float] = []
        floors: list[float] = []
        descs: list[int] = []
        for rep in range(reps + 2):  # two warm-up repetitions
            local, remote = self._pattern(pool_blocks, count, layout)
            runs = merge_runs(local, remote)
            f = 0.0
            if floor is not None and rep % 3 == 2:
                f = floor.time(runs)
            if rep % 2 == 0:
                w, d = _time_write(ep, peer, local, remote)
                if floor is not None and rep % 3 == 0:
                    f = floor.time(runs)
                c = _time_memcpy(src, dst, runs)
            else:
                c = _time_memcpy(src, dst, runs)
                if floor is not None and rep % 3 == 1:
                    f = floor.time(runs)
                w, d = _time_write(ep, peer, local, remote)
            if floor is not None and rep % 3 != 2 and f == 0.0:
                f = floor.time(runs)  # last: every position is taken over 6 reps
            if rep >= 2:
                writes.append(w)
                copies.append(c)
                floors.append(f)
                descs.append(d)
        return Row(
            blocks=count,
            block_len=block_len,
            layout=layout,
            descs=int(statistics.median(descs)),
            write_us=statistics.median(writes) * 1e6,
            memcpy_us=statistics.median(copies) * 1e6,
            nbytes=nbytes,
            floor_us=statistics.median(floors) * 1e6 if floor is not None else None,
        )

    def _verify(self, ep: NixlEndpoint, peer: PeerKey, pool_blocks: int, count: int) -> None:
        local, remote = self._pattern(pool_blocks, count, "scattered")
        notif = b"bench-verify"
        handle = ep.post_write(peer, local, remote, notif)
        _wait(ep, handle)
        ep.release(handle)
        self.conn.send(("verify", list(zip(remote, local, strict=True)), notif))
        result = self._recv("verified")[1]
        if result != "ok":
            raise RuntimeError(f"target verification failed: {result}")


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


class _CmaFloor:
    """The same runs written into the target with ONE direct ``process_vm_writev``."""

    IOV_MAX = 1024

    def __init__(self, pid: int, src: Sequence[_U8], remote_bases: Sequence[int]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._call = libc.process_vm_writev
        self._call.restype = ctypes.c_ssize_t
        self._call.argtypes = (
            ctypes.c_int,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        )
        self._pid = pid
        self._pairs = [
            (s.ctypes.data, base, s.shape[1]) for s, base in zip(src, remote_bases, strict=True)
        ]

    def time(self, runs: Sequence[tuple[int, int, int]]) -> float:
        """Seconds for the copy, including building the iovecs (as WRITE builds descriptors)."""
        t0 = time.perf_counter()
        local = [(la + ls * bl, n * bl) for la, _, bl in self._pairs for ls, _, n in runs]
        remote = [(ra + rs * bl, n * bl) for _, ra, bl in self._pairs for _, rs, n in runs]
        for i in range(0, len(local), self.IOV_MAX):
            lv = [_Iovec(a, n) for a, n in local[i : i + self.IOV_MAX]]
            rv = [_Iovec(a, n) for a, n in remote[i : i + self.IOV_MAX]]
            want = sum(n for _, n in local[i : i + self.IOV_MAX])
            larr = (_Iovec * len(lv))(*lv)
            rarr = (_Iovec * len(rv))(*rv)
            got = self._call(self._pid, larr, len(lv), rarr, len(rv), 0)
            if got != want:
                raise OSError(ctypes.get_errno(), f"process_vm_writev wrote {got} of {want} B")
        return time.perf_counter() - t0


def _wait(ep: NixlEndpoint, handle: WriteHandle) -> None:
    deadline = time.monotonic() + WAIT_S
    while (state := ep.poll(handle)) is TransferState.IN_PROGRESS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"WRITE not DONE within {WAIT_S} s")
    if state is not TransferState.DONE:
        raise RuntimeError(f"WRITE failed: {handle}")


def _time_write(
    ep: NixlEndpoint, peer: PeerKey, local: list[int], remote: list[int]
) -> tuple[float, int]:
    t0 = time.perf_counter()
    handle = ep.post_write(peer, local, remote)
    _wait(ep, handle)
    elapsed = time.perf_counter() - t0
    ep.release(handle)
    return elapsed, handle.num_descriptors


def _time_memcpy(src: Sequence[_U8], dst: Sequence[_U8], runs: list[tuple[int, int, int]]) -> float:
    t0 = time.perf_counter()
    for s, d in zip(src, dst, strict=True):
        for ls, rs, n in runs:
            np.copyto(d[rs : rs + n], s[ls : ls + n])
    return time.perf_counter() - t0


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _print_table(rows: Sequence[Row]) -> None:
    floor = any(r.floor_us is not None for r in rows)
    head = (
        f"{'blocks':>6} {'block':>8} {'layout':<10} {'descs':>5} {'write µs p50':>13} "
        f"{'memcpy µs p50':>14} {'write GB/s':>10} {'memcpy GB/s':>11} {'write/memcpy':>12}"
    )
    if floor:
        head += f" {'cma µs p50':>11} {'cma/memcpy':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (
            f"{r.blocks:>6} {_size(r.block_len):>8} {r.layout:<10} {r.descs:>5} "
            f"{r.write_us:>13.1f} {r.memcpy_us:>14.1f} {r.write_gbps:>10.2f} "
            f"{r.memcpy_gbps:>11.2f} {r.ratio:>12.2f}"
        )
        if r.floor_us is not None and r.floor_ratio is not None:
            line += f" {r.floor_us:>11.1f} {r.floor_ratio:>10.2f}"
        print(line)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pushkv bench dataplane",
        description="NIXL WRITE (2 processes, loopback) vs in-process numpy memcpy.",
    )
    p.add_argument("--quick", action="store_true", help="counts 1/8/64, fewer repetitions")
    p.add_argument("--reps", type=int, default=0, help="repetitions per combo (default: auto)")
    p.add_argument("--regions", type=int, default=1, help="KV regions per block (default 1)")
    p.add_argument("--max-mib", type=int, default=256, help="skip combos moving more MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--block-kib",
        type=int,
        action="append",
        choices=[b // KiB for b in BLOCK_SIZES],
        help="only this block size (repeatable; default: all)",
    )
    p.add_argument(
        "--cma-floor",
        action="store_true",
        help="also time one direct process_vm_writev of the same runs (kernel floor)",
    )
    args = p.parse_args(argv)
    if args.regions < 1 or args.reps < 0:
        p.error("--regions must be >= 1 and --reps >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    for key, value in quiet_nixl_env(loopback=True).items():
        os.environ.setdefault(key, value)
    counts_all = QUICK_COUNTS if args.quick else BLOCK_COUNTS
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(target=_target_main, args=(child_conn,), name="bench-target")
    target.start()
    child_conn.close()
    t_start = time.monotonic()
    rows: list[Row] = []
    try:
        bench = _Bench(conn, args)
        sizes = [b for b in BLOCK_SIZES if not args.block_kib or b // KiB in args.block_kib]
        for block_len in sizes:
            counts = [c for c in counts_all if c * block_len * args.regions <= args.max_mib * MiB]
            if counts:
                rows += bench.run_size(block_len, counts)
        conn.send(("exit",))
    finally:
        target.join(WAIT_S)
        if target.is_alive():
            target.kill()
            target.join(WAIT_S)
    print(
        f"# NIXL WRITE (UCX, 2 processes, {os.environ.get('UCX_NET_DEVICES')}) vs numpy copyto; "
        f"regions={args.regions} cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f} "
        f"elapsed={time.monotonic() - t_start:.1f}s"
    )
    _print_table(rows)
    goal = {r.layout: r for r in rows if (r.blocks, r.block_len) == GOAL}
    if len(goal) == 2:
        print(
            f"write_vs_memcpy_64x128KiB_scattered={goal['scattered'].ratio:.2f} "
            f"contiguous={goal['contiguous'].ratio:.2f}"
        )
        sf, cf = goal["scattered"].floor_ratio, goal["contiguous"].floor_ratio
        if sf is not None and cf is not None:
            print(f"cma_floor_vs_memcpy_64x128KiB_scattered={sf:.2f} contiguous={cf:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
