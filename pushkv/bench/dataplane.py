"""``pushkv bench dataplane``: NIXL WRITE vs in-process numpy memcpy, same block patterns.

One run spawns a target process and, for each block size (16 KiB, 128 KiB, 1 MiB)
and block count (1, 8, 64, 256; combos above ``--max-mib`` skipped), measures
alternately:

* WRITE: ``NixlEndpoint.post_write`` -> DONE as seen by the initiator (includes
  building the request; no notification; handle released outside the timing);
* memcpy: a copy of the same blocks with the same pattern in-process, one
  copy per merged run (the same runs NIXL gets as descriptors): ``np.copyto``,
  or with ``--memory vram`` (both sides' pools on the GPU, registered as VRAM)
  one ``cuMemcpyDtoDAsync`` per run and one synchronisation
  (pushkv/bench/dataplane_memory.py).

* with ``--cma-floor``, also the kernel floor of that WRITE: the same bytes
  moved into the target by ``process_vm_writev`` called directly (ctypes), ONE
  call carrying every run as an iovec.  UCX's CMA transport makes one such
  call per descriptor (per 512 KiB segment), so WRITE time minus this floor is
  what NIXL, UCX and the per-descriptor system calls add.

"scattered" draws fresh random distinct block ids on BOTH sides per repetition
(so runs rarely merge); "contiguous" writes blocks [s, s+n) to [t, t+n).  All
buffers are pre-touched.  After each block size one scattered WRITE with a
notification is verified byte-for-byte by the target.  Single host: it
sets ``UCX_NET_DEVICES=lo`` unless already set.

The target progresses its NIXL agent every ``--target-poll-ms`` (default
0.5 ms, the decode agent's fast poll while it expects arrivals) while it waits.
Over CMA that changes nothing; over UCX's TCP transport (``UCX_TLS=tcp,self``)
a WRITE is not one-sided and lands only while the target progresses: 0 means
never progress while idle, and such a WRITE never completes.

With ``--link RATE`` (e.g. ``1gbit``) the initiator and the target run in two
network namespaces joined by a veth pair capped at RATE each way by tc
(:mod:`pushkv.harness.netlink`), UCX over TCP across it; each row then also shows the
line time (payload bytes / RATE) and WRITE time / line time.  Needs root.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pushkv.agent.nixl_adapter import NixlEndpoint, quiet_nixl_env
from pushkv.agent.nixl_types import KVRegion, PeerKey, TransferState, WriteHandle
from pushkv.agent.write_plan import merge_runs
from pushkv.bench.children import reap
from pushkv.bench.dataplane_memory import KINDS, CudaMemory, Memory, Pool, describe, memory_for
from pushkv.bench.dataplane_target import FILL, WAIT_S, _target_main
from pushkv.harness.netlink import NetnsProcess, TwoNodeLink, format_rate, parse_rate

KiB = 1024
MiB = 1024 * KiB
BLOCK_SIZES = (16 * KiB, 128 * KiB, 1 * MiB)
BLOCK_COUNTS = (1, 8, 64, 256)
QUICK_COUNTS = (1, 8, 64)
GOAL = (64, 128 * KiB)
LINK_MAX_MIB = 16

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
    line_us: float | None = None
    kernel_us: float | None = None  # --memory vram: one gather+scatter (dataplane_memory.py)

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
        self.mem: Memory = memory_for(args.memory)

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
        mem = self.mem
        self.conn.send(
            ("setup", f"bench-target-{tag}", block_len, pool_blocks, regions, self.args.memory)
        )
        src = [mem.pattern(pool_blocks, block_len) for _ in range(regions)]
        dst = [mem.pool(pool_blocks, block_len, FILL) for _ in range(regions)]
        rows: list[Row] = []
        with NixlEndpoint(f"bench-init-{tag}", memory=mem.kind) as ep:
            ep.register_kv(
                [KVRegion(mem.addr(p), block_len, pool_blocks, mem.device_id) for p in src]
            )
            _, md, layout, pid = self._recv("ready")
            peer = PeerKey(f"bench-target-{tag}", "0")
            ep.add_peer(peer, md, [KVRegion(a, bl, n, mem.device_id) for a, bl, n in layout])
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
        src: Sequence[Pool],
        dst: Sequence[Pool],
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
        kernels: list[float] = []
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
                c = _time_memcpy(self.mem, src, dst, runs)
            else:
                c = _time_memcpy(self.mem, src, dst, runs)
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
                if isinstance(self.mem, CudaMemory):
                    cols = (0, block_len)
                    kernels.append(_time_kernel(self.mem, src, dst, remote, local, cols, cols))
        return Row(
            blocks=count,
            block_len=block_len,
            layout=layout,
            descs=int(statistics.median(descs)),
            write_us=statistics.median(writes) * 1e6,
            memcpy_us=statistics.median(copies) * 1e6,
            nbytes=nbytes,
            floor_us=statistics.median(floors) * 1e6 if floor is not None else None,
            kernel_us=statistics.median(kernels) * 1e6 if kernels else None,
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

    def __init__(self, pid: int, src: Sequence[Pool], remote_bases: Sequence[int]) -> None:
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


def _time_kernel(
    mem: CudaMemory,
    src: Sequence[Pool],
    dst: Sequence[Pool],
    dst_blocks: list[int],
    src_blocks: list[int],
    dst_cols: tuple[int, int],
    src_cols: tuple[int, int],
) -> float:
    """Seconds for the same blocks moved by indexing kernels (GPU reference)."""
    t0 = time.perf_counter()
    for s, d in zip(src, dst, strict=True):
        mem.kernel_copy(d, s, dst_blocks, src_blocks, dst_cols, src_cols)
    mem.done()
    return time.perf_counter() - t0


def _time_memcpy(
    mem: Memory, src: Sequence[Pool], dst: Sequence[Pool], runs: list[tuple[int, int, int]]
) -> float:
    bl = src[0].shape[1]
    t0 = time.perf_counter()
    spans = [(rs * bl, ls * bl, n * bl) for ls, rs, n in runs]
    for s, d in zip(src, dst, strict=True):
        mem.copy_runs(d, s, spans)
    mem.done()
    return time.perf_counter() - t0


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _print_table(rows: Sequence[Row]) -> None:
    floor = any(r.floor_us is not None for r in rows)
    line = any(r.line_us is not None for r in rows)
    kernel = any(r.kernel_us is not None for r in rows)
    head = (
        f"{'blocks':>6} {'block':>8} {'layout':<10} {'descs':>5} {'write µs p50':>13} "
        f"{'memcpy µs p50':>14} {'write GB/s':>10} {'memcpy GB/s':>11} {'write/memcpy':>12}"
    )
    if floor:
        head += f" {'cma µs p50':>11} {'cma/memcpy':>10}"
    if line:
        head += f" {'line µs':>10} {'write/line':>10}"
    if kernel:
        head += f" {'kernel µs p50':>13} {'write/kernel':>12}"
    print(head)
    print("-" * len(head))
    for r in rows:
        text = (
            f"{r.blocks:>6} {_size(r.block_len):>8} {r.layout:<10} {r.descs:>5} "
            f"{r.write_us:>13.1f} {r.memcpy_us:>14.1f} {r.write_gbps:>10.2f} "
            f"{r.memcpy_gbps:>11.2f} {r.ratio:>12.2f}"
        )
        if r.floor_us is not None and r.floor_ratio is not None:
            text += f" {r.floor_us:>11.1f} {r.floor_ratio:>10.2f}"
        if r.line_us is not None:
            text += f" {r.line_us:>10.1f} {r.write_us / r.line_us:>10.2f}"
        if r.kernel_us is not None:
            text += f" {r.kernel_us:>13.1f} {r.kernel_us / r.write_us:>12.3f}"
        print(text)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pushkv bench dataplane",
        description="NIXL WRITE (2 processes, loopback) vs in-process memcpy.",
    )
    p.add_argument(
        "--memory",
        choices=KINDS,
        default="dram",
        help="where both sides' pools live: host memory (numpy) or GPU memory (torch on "
        "cuda:0, registered as VRAM; memcpy is then one device-to-device copy per run)",
    )
    p.add_argument("--quick", action="store_true", help="counts 1/8/64, fewer repetitions")
    p.add_argument("--reps", type=int, default=0, help="repetitions per combo (default: auto)")
    p.add_argument("--regions", type=int, default=1, help="KV regions per block (default 1)")
    p.add_argument(
        "--max-mib", type=int, default=None, help="skip combos moving more MiB (default 256)"
    )
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
    p.add_argument(
        "--target-poll-ms",
        type=float,
        default=0.5,
        help="the target progresses NIXL this often while it waits (default 0.5, the decode "
        "agent's fast poll; 0: never, and a WRITE over UCX's TCP transport never completes)",
    )
    p.add_argument(
        "--link",
        metavar="RATE",
        default="",
        help="run over the emulated two-node link capped at RATE (e.g. 1gbit; needs root); "
        "--max-mib then defaults to 16",
    )
    p.add_argument(
        "--resized",
        action="store_true",
        help="token-range WRITEs between different block sizes (32->64 and 64->32 tokens, 8 "
        "heads; the block size is the 64-token block's) against whole-block WRITEs and "
        "memcpy of the same bytes",
    )
    p.add_argument(
        "--sliced",
        action="store_true",
        help="head-slice WRITEs between different TP sizes (2->1 and 1->2; the block size "
        "is the larger side's) instead of whole blocks, against memcpy of the same slices",
    )
    args = p.parse_args(argv)
    if args.regions < 1 or args.reps < 0 or args.target_poll_ms < 0:
        p.error("--regions must be >= 1, --reps and --target-poll-ms >= 0")
    if args.memory == "vram" and (args.link or args.cma_floor or args.resized):
        p.error(
            "--memory vram runs whole blocks or --sliced on one host only "
            "(no --link, --cma-floor or --resized: they measure host-memory paths)"
        )
    if args.link:
        if args.cma_floor:
            p.error("--cma-floor measures CMA; it does not apply to --link")
        try:
            args.link_bit = parse_rate(args.link)
        except ValueError as exc:
            p.error(str(exc))
        if args.max_mib is None:
            args.max_mib = LINK_MAX_MIB
    if args.max_mib is None:
        args.max_mib = 256
    return args


def _run_resized(args: argparse.Namespace) -> None:
    """--resized: its own table (resized vs whole-block WRITE vs memcpy)."""
    from pushkv.bench.dataplane_resized import print_resized, run_resized

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(
        target=_target_main, args=(child_conn, args.target_poll_ms / 1e3), name="bench-target"
    )
    target.start()
    child_conn.close()
    t_start = time.monotonic()
    bench = _Bench(conn, args)
    rows = []
    try:
        counts_all = QUICK_COUNTS if args.quick else BLOCK_COUNTS
        for block_len in [
            b for b in BLOCK_SIZES if not args.block_kib or b // KiB in args.block_kib
        ]:
            counts = [c for c in counts_all if c * block_len * args.regions <= args.max_mib * MiB]
            if counts:
                rows += run_resized(bench, block_len, counts)
        conn.send(("exit",))
    finally:
        reap([target], WAIT_S)
    print(
        f"# resized NIXL WRITE (UCX, 2 processes, {os.environ.get('UCX_NET_DEVICES')}) vs "
        f"whole-block WRITE vs numpy copyto; regions={args.regions} cpus={os.cpu_count()} "
        f"load={os.getloadavg()[0]:.2f} elapsed={time.monotonic() - t_start:.1f}s"
    )
    print_resized(rows)
    for r in rows:
        if (r.blocks, r.block_len) == GOAL:
            print(
                f"resized_{r.head}_{r.direction.replace('->', 'to')}_{r.layout}_64x128KiB "
                f"vs_whole={r.vs_whole:.2f} vs_memcpy={r.vs_memcpy:.2f} descs={r.descs} "
                f"whole_descs={r.whole_descs}"
            )


def _run_sizes(bench: _Bench, args: argparse.Namespace) -> list[Row]:
    counts_all = QUICK_COUNTS if args.quick else BLOCK_COUNTS
    rows: list[Row] = []
    sizes = [b for b in BLOCK_SIZES if not args.block_kib or b // KiB in args.block_kib]
    for block_len in sizes:
        counts = [c for c in counts_all if c * block_len * args.regions <= args.max_mib * MiB]
        if counts and args.sliced:
            from pushkv.bench.dataplane_sliced import run_sliced

            rows += run_sliced(bench, block_len, counts)
        elif counts:
            rows += bench.run_size(block_len, counts)
    return rows


def _initiator_main(conn: Connection, args: argparse.Namespace) -> None:
    """The initiator in the link's namespace A; its conn reaches the target through a relay."""
    rows = _run_sizes(_Bench(conn, args), args)
    conn.send(("exit",))
    conn.send(("rows", rows))


def _relay(init: Connection, target: Connection) -> list[Row]:
    """Pass messages between initiator and target until the initiator sends its rows."""
    from multiprocessing.connection import wait

    while True:
        ready = wait([init, target], timeout=WAIT_S * 8)
        if not ready:
            raise TimeoutError(f"no message from initiator or target within {WAIT_S * 8} s")
        for c in (init, target):
            if c not in ready:
                continue
            try:
                msg = c.recv()
            except EOFError:
                who = "initiator" if c is init else "target"
                raise RuntimeError(f"the {who} exited (see its output above)") from None
            if c is init and msg[0] == "rows":
                rows: list[Row] = msg[1]
                return rows
            (target if c is init else init).send(msg)


def _run_link(args: argparse.Namespace) -> list[Row]:
    with TwoNodeLink(args.link_bit) as link:
        target = NetnsProcess(
            link, "b", "pushkv.bench.dataplane_target:_target_main", (args.target_poll_ms / 1e3,)
        )
        init = NetnsProcess(link, "a", "pushkv.bench.dataplane:_initiator_main", (args,))
        target.start()
        init.start()
        try:
            rows = _relay(init.conn, target.conn)
        finally:
            for proc in (init, target):
                proc.join(WAIT_S)
                proc.kill()
                proc.join(5)
        print(
            f"# link: veth {link.side('a').kv_dev}<->{link.side('b').kv_dev}, tbf "
            f"{format_rate(link.rate_bit)} each way, burst {link.burst_b} B, latency "
            f"{link.latency_ms} ms; UCX_TLS=tcp; A->B qdisc {link.qdisc_stats('a')}"
        )
        return [dataclasses.replace(r, line_us=link.line_time_s(r.nbytes) * 1e6) for r in rows]


def _run_local(args: argparse.Namespace) -> list[Row]:
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(
        target=_target_main, args=(child_conn, args.target_poll_ms / 1e3), name="bench-target"
    )
    target.start()
    child_conn.close()
    try:
        rows = _run_sizes(_Bench(conn, args), args)
        conn.send(("exit",))
    finally:
        reap([target], WAIT_S)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    mem = memory_for(args.memory)  # refused with the reason before any process starts
    for key, value in quiet_nixl_env(loopback=True).items():
        os.environ.setdefault(key, value)
    if args.resized:
        if args.link or args.sliced or args.cma_floor:
            raise SystemExit("--resized runs on its own (no --link, --sliced, --cma-floor)")
        _run_resized(args)
        return 0
    t_start = time.monotonic()
    rows = _run_link(args) if args.link else _run_local(args)
    where = (
        f"link {args.link}, UCX_TLS=tcp"
        if args.link
        else f"{os.environ.get('UCX_NET_DEVICES')}"
        + (f", UCX_TLS={os.environ['UCX_TLS']}" if "UCX_TLS" in os.environ else "")
    )
    print(
        f"# NIXL WRITE (UCX, 2 processes, {where}) of {describe(mem)} vs {mem.copy_name}; "
        f"regions={args.regions} target_poll_ms={args.target_poll_ms} cpus={os.cpu_count()} "
        f"load={os.getloadavg()[0]:.2f} elapsed={time.monotonic() - t_start:.1f}s"
    )
    _print_table(rows)
    goal = {r.layout: r for r in rows if (r.blocks, r.block_len) == GOAL}
    if args.sliced and goal:
        print(
            "sliced_write_vs_memcpy_64x128KiB "
            + " ".join(f"{k.replace(' ', '_')}={r.ratio:.2f}" for k, r in sorted(goal.items()))
        )
    kernels = {k: r.kernel_us for k, r in goal.items() if r.kernel_us is not None}
    if kernels:
        print(
            "write_vs_kernel_64x128KiB "
            + " ".join(
                f"{k.replace(' ', '_')}={us / goal[k].write_us:.3f}"
                for k, us in sorted(kernels.items())
            )
        )
    if len(goal) == 2:
        print(
            f"write_vs_memcpy_64x128KiB_scattered={goal['scattered'].ratio:.2f} "
            f"contiguous={goal['contiguous'].ratio:.2f}"
        )
        sf, cf = goal["scattered"].floor_ratio, goal["contiguous"].floor_ratio
        if sf is not None and cf is not None:
            print(f"cma_floor_vs_memcpy_64x128KiB_scattered={sf:.2f} contiguous={cf:.2f}")
        sl, cl = goal["scattered"].line_us, goal["contiguous"].line_us
        if sl is not None and cl is not None:
            print(
                f"link_write_vs_line_64x128KiB_scattered={goal['scattered'].write_us / sl:.2f} "
                f"contiguous={goal['contiguous'].write_us / cl:.2f} rate={args.link} "
                f"target_poll_ms={args.target_poll_ms}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
