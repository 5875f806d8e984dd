"""`pushkv bench order`: from the rendezvous to the WRITE, on real agents.

A coordinator process and two KV-host processes (real agents, NIXL/UCX on
loopback). For each transfer the decode side registers and the prefill side
reports done (alternating which comes last). Printed per stage, from the
coordinator's timeline (one clock, so no cross-process skew):

  ordered -> write_posted   the order reached the prefill agent and the WRITE was
                            posted, plus the POSTED report's way back
  ordered -> write_done     ... and the WRITE completed
  ordered -> arrived        the decode agent counted the notification and reported

and, at the client, from the last rendezvous RPC returning to the decode host
seeing KV_READY.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

import grpc

from pushkv.agent.events import EventKind
from pushkv.bench.stats import percentile
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.harness.rendezvous import rendezvous
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv bench order", description=__doc__)
    ap.add_argument("--transfers", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per transfer")
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    n = min(args.transfers, 60) if args.quick else args.transfers
    rng = random.Random(5)
    stages: dict[str, list[float]] = {"write_posted": [], "write_done": [], "arrived": []}
    client_ms: list[float] = []
    with CoordinatorProcess("--log-level", "WARNING") as coord:
        spec = {"num_blocks": 256, "block_len": args.block_kib * 1024, "num_regions": 2}
        p = KVHost(HostSpec(coord.address, "P", "prefill", **spec)).start()
        d = KVHost(HostSpec(coord.address, "D", "decode", **spec)).start()
        try:
            ch = grpc.insecure_channel(coord.address)
            req, status = pbg.TransferServiceStub(ch), pbg.StatusServiceStub(ch)
            tokens = args.blocks * 16
            for i in range(n + 5):  # the first 5 warm up connections and caches
                tid = f"b{i}"
                src = rng.sample(range(256), args.blocks)
                dst = rng.sample(range(256), args.blocks)
                d.call("expect", [tid])
                rendezvous(
                    req,
                    tid,
                    prefill="P",
                    decode="D",
                    src=src,
                    dst=dst,
                    num_tokens=tokens,
                    decode_first=bool(i % 2),
                )
                t0 = time.monotonic()
                ev = d.wait_event(tid, timeout=20)
                elapsed = (time.monotonic() - t0) * 1000
                p.wait_event(tid, timeout=20)
                if ev.kind is not EventKind.KV_READY:
                    sys.stderr.write(f"{tid}: {ev}\n")
                    return 1
                if i < 5:
                    continue
                client_ms.append(elapsed)
                t = status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)
                first = {e.stage: e.unix_us for e in reversed(t.timeline)}
                for stage, values in stages.items():
                    if stage in first and "ordered" in first:
                        values.append((first[stage] - first["ordered"]) / 1000)
        finally:
            p.stop()
            d.stop()
    mib = args.blocks * args.block_kib * 2 / 1024
    out = sys.stdout
    out.write(
        f"{n} transfers of {args.blocks} scattered blocks x 2 regions x "
        f"{args.block_kib} KiB ({mib:.2f} MiB each)\n"
    )
    out.write(f"{'from ordered to':28s} {'p50 ms':>8} {'p99 ms':>8}\n")
    for stage, values in stages.items():
        out.write(f"{stage:28s} {percentile(values, 50):8.3f} {percentile(values, 99):8.3f}\n")
    out.write(
        f"{'client: RPC -> KV_READY':28s} {percentile(client_ms, 50):8.3f} "
        f"{percentile(client_ms, 99):8.3f}\n"
    )
    out.write(
        f"order_to_post_p50_ms={percentile(stages['write_posted'], 50):.3f} "
        f"order_to_post_p99_ms={percentile(stages['write_posted'], 99):.3f} "
        f"mean_kv_ready_ms={statistics.fmean(client_ms):.3f}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
