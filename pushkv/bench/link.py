"""``pushkv bench link``: whole transfers between real agents over the emulated two-node link.

A coordinator on the host, a prefill KV host in namespace A and a decode KV
host in namespace B (:mod:`pushkv.harness.netlink`), NIXL over UCX's TCP transport on
a veth pair capped by tc at ``--rate`` each way.  Each transfer registers the
decode blocks first, then reports the prefill done; the time is from that
report's send to the decode host's KV_READY as seen by this process (it
includes the order's trip through the coordinator and the KV host's 2 ms pipe
poll), against the line time of the payload (bytes / rate).

Two modes show what the decode agent's progress costs over TCP, where a WRITE
lands only while the target progresses UCX:

* ``expect``: the decode host calls ``Agent.expect`` first (as the vLLM
  connector's worker does), so its NIXL thread polls every 0.5 ms;
* ``idle``: no expectation, and the transfer starts after the agent's idle
  backoff has reached its ceiling (50 ms between polls).

The first transfer (connection set-up) is not timed; the bytes of the first
and last transfer of each mode are verified.  Needs root.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import grpc

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec
from pushkv.harness.netlink import NetnsKVHost, TwoNodeLink, format_rate, parse_rate
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

TOKENS_PER_BLOCK = 16
IDLE_SETTLE_S = 0.3  # longer than the agent's backoff from 0.5 ms up to 50 ms


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pushkv bench link",
        description="Agent-to-agent transfers over the emulated two-node link (needs root).",
    )
    p.add_argument("--rate", default="1gbit", help="the link's rate each way (default 1gbit)")
    p.add_argument("--blocks", type=int, default=64, help="blocks per transfer (default 64)")
    p.add_argument("--block-kib", type=int, default=64, help="bytes per block per region, KiB")
    p.add_argument("--regions", type=int, default=2, help="KV regions (K and V: 2)")
    p.add_argument("--runs", type=int, default=5, help="timed transfers per mode (default 5)")
    p.add_argument(
        "--modes", default="expect,idle", help="comma-separated: expect, idle (default both)"
    )
    args = p.parse_args(argv)
    try:
        args.rate_bit = parse_rate(args.rate)
    except ValueError as exc:
        p.error(str(exc))
    args.mode_list = [m for m in args.modes.split(",") if m]
    if not args.mode_list or set(args.mode_list) - {"expect", "idle"}:
        p.error("--modes: expect and/or idle")
    if min(args.blocks, args.block_kib, args.regions, args.runs) < 1:
        p.error("--blocks, --block-kib, --regions and --runs must be >= 1")
    return args


@dataclasses.dataclass
class _Setup:
    req: pbg.TransferServiceStub
    prefill: NetnsKVHost
    decode: NetnsKVHost
    src: list[int]
    dst: list[int]
    n_tokens: int


def _transfer(s: _Setup, tid: str, mode: str, seed: int, verify: bool) -> float:
    if verify:
        s.decode.call("canary", 0x5A)
    if mode == "expect":
        s.decode.call("expect", [tid])
    else:
        time.sleep(IDLE_SETTLE_S)
    s.req.RegisterDecodeBlocks(
        pb.RegisterDecodeBlocksRequest(
            transfer_id=tid,
            decode_engine_id="D",
            block_ids=[pb.BlockIds(ids=s.dst)],
            num_tokens=s.n_tokens,
        ),
        timeout=10,
    )
    t0 = time.perf_counter()
    s.req.ReportPrefillDone(
        pb.ReportPrefillDoneRequest(
            transfer_id=tid,
            prefill_engine_id="P",
            block_ids=[pb.BlockIds(ids=s.src)],
            num_tokens=s.n_tokens,
        ),
        timeout=10,
    )
    event = s.decode.wait_event(tid, timeout=60)
    elapsed = time.perf_counter() - t0
    if event.kind is not EventKind.KV_READY:
        raise RuntimeError(f"{tid}: {event.kind.value} {event.detail}")
    s.prefill.wait_event(tid, timeout=30)  # BLOCKS_FREE
    if verify and (bad := s.decode.check(s.dst, seed)):
        raise RuntimeError(f"{tid}: block positions {bad} differ after the transfer")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    block_len = args.block_kib * 1024
    nbytes = args.blocks * block_len * args.regions
    t_start = time.monotonic()
    results: dict[str, list[float]] = {}
    with TwoNodeLink(args.rate_bit) as link:
        coord = CoordinatorProcess(
            "--host",
            link.coordinator_host,
            "--log-level",
            "WARNING",
        ).start()
        addr = f"{link.coordinator_host}:{coord.port}"
        kw = {"num_blocks": 2 * args.blocks, "block_len": block_len, "num_regions": args.regions}
        p = NetnsKVHost(HostSpec(addr, "P", "prefill", **kw), link, "a")
        d = NetnsKVHost(HostSpec(addr, "D", "decode", **kw), link, "b")
        try:
            p.start()
            d.start()
            src = list(range(args.blocks))
            dst = list(range(2 * args.blocks - 1, args.blocks - 1, -1))
            p.fill(src, seed=1)
            channel = grpc.insecure_channel(addr)
            s = _Setup(pbg.TransferServiceStub(channel), p, d, src, dst, args.blocks * 16)
            _transfer(s, "warmup", "expect", 1, verify=True)
            before = link.qdisc_stats("a")
            for mode in args.mode_list:
                times = results.setdefault(mode, [])
                for i in range(args.runs):
                    verify = i in (0, args.runs - 1)
                    times.append(_transfer(s, f"{mode}-{i}", mode, 1, verify))
            after = link.qdisc_stats("a")
            channel.close()
        finally:
            for h in (p, d):
                h.stop()
            coord.stop()
    line_ms = nbytes * 8 / args.rate_bit * 1e3
    print(
        f"# agents over the emulated link: tbf {format_rate(args.rate_bit)} each way, "
        f"UCX_TLS=tcp; {args.blocks} blocks x {args.block_kib} KiB x {args.regions} regions = "
        f"{nbytes / 2**20:.1f} MiB per transfer; A->B qdisc +{after.bytes - before.bytes} B, "
        f"overlimits +{after.overlimits - before.overlimits}; elapsed "
        f"{time.monotonic() - t_start:.1f}s"
    )
    head = (
        f"{'mode':<8} {'runs':>4} {'p50 ms':>8} {'min ms':>8} {'max ms':>8} "
        f"{'line ms':>8} {'p50/line':>8}"
    )
    print(head)
    print("-" * len(head))
    ratios: dict[str, float] = {}
    for mode, times in results.items():
        ms = [t * 1e3 for t in times]
        p50 = statistics.median(ms)
        ratios[mode] = p50 / line_ms
        print(
            f"{mode:<8} {len(ms):>4} {p50:>8.1f} {min(ms):>8.1f} {max(ms):>8.1f} "
            f"{line_ms:>8.1f} {ratios[mode]:>8.2f}"
        )
    print(
        "link_transfer_p50_vs_line "
        + " ".join(f"{m}={r:.2f}" for m, r in ratios.items())
        + f" rate={args.rate}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
