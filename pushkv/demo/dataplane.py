"""`pushkv demo`: a real data-plane run on this machine.

A coordinator process, a prefill KV host and a decode KV host (each a process
with a real agent over NIXL/UCX on loopback). Transfers run in both arrival
orders with scattered block ids; every byte is verified on the decode side.
"""

from __future__ import annotations

import random
import sys
import time

import grpc

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.harness.rendezvous import rendezvous
from pushkv.tools.tables import engines_table, transfers_table
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

NUM_BLOCKS = 64
TOKENS_PER_BLOCK = 16


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run(transfers: int = 8) -> int:
    rng = random.Random(7)
    t0 = time.monotonic()
    with CoordinatorProcess("--log-level", "WARNING") as coord:
        _say(f"coordinator listening on {coord.address}")
        prefill = KVHost(HostSpec(coord.address, "prefill-0", "prefill", num_blocks=NUM_BLOCKS))
        decode = KVHost(HostSpec(coord.address, "decode-0", "decode", num_blocks=NUM_BLOCKS))
        try:
            prefill.start()
            decode.start()
            _say(f"agents registered: {prefill.agent_name}, {decode.agent_name}")
            channel = grpc.insecure_channel(coord.address)
            req = pbg.TransferServiceStub(channel)
            status = pbg.StatusServiceStub(channel)
            failures = 0
            for i in range(2 * transfers):
                tid = f"demo-{i:03d}"
                decode_first = i % 2 == 0
                n_blocks = rng.randint(1, 12)
                num_tokens = (n_blocks - 1) * TOKENS_PER_BLOCK + rng.randint(1, TOKENS_PER_BLOCK)
                src = rng.sample(range(NUM_BLOCKS), n_blocks)  # scattered, non-contiguous
                dst = rng.sample(range(NUM_BLOCKS), n_blocks)
                decode.call("canary", 0xAB)
                prefill.fill(src, seed=i)
                decode.call("expect", [tid])
                started = time.monotonic()
                rendezvous(
                    req,
                    tid,
                    prefill="prefill-0",
                    decode="decode-0",
                    src=src,
                    dst=dst,
                    num_tokens=num_tokens,
                    decode_first=decode_first,
                )
                ready = decode.wait_event(tid, timeout=20)
                elapsed_ms = (time.monotonic() - started) * 1000
                freed = prefill.wait_event(tid, timeout=20)
                bad = decode.check(dst, seed=i)
                ok = ready.kind is EventKind.KV_READY and not bad
                failures += not ok
                _say(
                    f"{tid}: {'decode-first ' if decode_first else 'prefill-first'} "
                    f"{n_blocks:2d} blocks -> {ready.kind.value:9s} in {elapsed_ms:6.1f} ms, "
                    f"prefill {freed.kind.value}, bytes {'verified' if not bad else f'BAD {bad}'}"
                )
            listed = status.ListTransfers(pb.ListTransfersRequest(limit=1000), timeout=10)
            _say("\n" + transfers_table(sorted(listed.transfers, key=lambda t: t.transfer_id)))
            engines = status.ListEngines(pb.ListEnginesRequest(), timeout=10)
            _say("\n" + engines_table(engines.engines))
            channel.close()
            complete = sum(t.state == pb.TRANSFER_STATE_COMPLETE for t in listed.transfers)
            _say(
                f"\n{complete}/{2 * transfers} transfers complete, {failures} failed, "
                f"{time.monotonic() - t0:.1f} s"
            )
            return 0 if failures == 0 and complete == 2 * transfers else 1
        finally:
            prefill.stop()
            decode.stop()


if __name__ == "__main__":
    raise SystemExit(run())
