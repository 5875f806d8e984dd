"""``pushkv bench transport``: the gRPC floor under the coordinator's figures.

What a Python gRPC server on this host spends per call before any pushkv code
runs: a do-nothing server on pushkv's own contract (``Submit`` answers one
empty result per call; ``AgentStream`` answers each message with an empty
one), alone on the coordinator's CPU as in ``pushkv bench cluster``, and
clients on the other CPUs. Its CPU seconds (/proc) per call are the floor that
the leader's CPU per rendezvous in ``pushkv bench cluster`` is to be read
against: a TP-8 rendezvous there costs the leader two ``Submit`` RPCs (the
decode registration and the prefill report, one call each at the bench's
per-engine rates) and a few stream messages each way.

Measured, each round in this order and the rounds alternated: unary
``Submit`` carrying 1, 8 and 64 calls (``--concurrency`` in flight, as many
engines' scheduler clients would), then stream message pairs (one up, one
down) on one ``AgentStream``. The median of ``--rounds`` rounds is printed.
The final line:

    unary_us=<u> unary_8_calls_us=<u8> unary_64_calls_us=<u64> stream_pair_us=<s>
    unary_rpcs_per_core=<r>

(one line; folded here).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from bench.coordinator_server import cpu_seconds, cpu_split, pin
from bench.output import say

BATCHES = (1, 8, 64)  # calls per Submit


def _server_main(conn: Connection, cpus: set[int] | None) -> None:
    """Process entry: serve the do-nothing servicers until the controller says "stop"."""
    pin(cpus)
    import grpc
    from pushkv.v1 import pushkv_pb2 as pb

    async def submit(request: Any, context: Any) -> Any:
        out = pb.SubmitResponse()
        for _ in request.calls:
            out.results.add()
        return out

    async def agent_stream(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async for _ in request_iterator:
            yield pb.CoordinatorMessage()

    handlers = (
        grpc.method_handlers_generic_handler(
            "pushkv.v1.TransferService",
            {
                "Submit": grpc.unary_unary_rpc_method_handler(
                    submit,
                    request_deserializer=pb.SubmitRequest.FromString,
                    response_serializer=pb.SubmitResponse.SerializeToString,
                )
            },
        ),
        grpc.method_handlers_generic_handler(
            "pushkv.v1.AgentService",
            {
                "AgentStream": grpc.stream_stream_rpc_method_handler(
                    agent_stream,
                    request_deserializer=pb.AgentMessage.FromString,
                    response_serializer=pb.CoordinatorMessage.SerializeToString,
                )
            },
        ),
    )

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(handlers)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.to_thread(conn.recv)  # "stop"
        await server.stop(0)

    asyncio.run(run())


def _register_call(i: int) -> Any:
    """A decode registration as the bench's engines send it (TP-8, 16 blocks)."""
    from pushkv.v1 import pushkv_pb2 as pb

    return pb.TransferCall(
        register=pb.RegisterDecodeBlocksRequest(
            transfer_id=f"bench-transport-{i:08d}",
            decode_engine_id="decode-0",
            block_ids=[pb.BlockIds(ids=list(range(16)))],
            num_tokens=256,
        )
    )


async def _measure(port: int, pid: int, n: int, concurrency: int) -> dict[str, float]:
    """Server CPU µs per unary Submit (per batch size) and per stream message pair."""
    import grpc
    from pushkv.v1 import pushkv_pb2 as pb
    from pushkv.v1 import pushkv_pb2_grpc as pbg

    out: dict[str, float] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pbg.TransferServiceStub(ch)
        for k in BATCHES:
            request = pb.SubmitRequest(calls=[_register_call(i) for i in range(k)])
            await stub.Submit(request, timeout=30)  # the channel is up
            c0 = cpu_seconds(pid)
            for _ in range(max(1, n // concurrency)):
                await asyncio.gather(
                    *(stub.Submit(request, timeout=30) for _ in range(concurrency))
                )
            calls = max(1, n // concurrency) * concurrency
            out[f"unary_{k}"] = (cpu_seconds(pid) - c0) / calls * 1e6
        q: asyncio.Queue[Any] = asyncio.Queue()

        async def messages() -> AsyncIterator[Any]:
            while (m := await q.get()) is not None:
                yield m

        stream = pbg.AgentServiceStub(ch).AgentStream(messages(), timeout=300)
        q.put_nowait(pb.AgentMessage())
        await stream.read()
        c0 = cpu_seconds(pid)
        rounds = max(1, n // concurrency)
        for _ in range(rounds):
            for _ in range(concurrency):
                q.put_nowait(pb.AgentMessage())
            for _ in range(concurrency):
                await stream.read()
        out["stream"] = (cpu_seconds(pid) - c0) / (rounds * concurrency) * 1e6
        q.put_nowait(None)
        await stream.read()  # the end of the server's stream
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv bench transport", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer calls per measurement")
    ap.add_argument("--calls", type=int, default=8000, help="RPCs (or message pairs) measured")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=50, help="RPCs in flight at once")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls = min(args.calls, 2000)
    if args.calls < 1 or args.rounds < 1 or args.concurrency < 1:
        ap.error("--calls, --rounds and --concurrency must be >= 1")
    server_cpus, client_cpus = cpu_split()
    # The clients run here, pinned for the run only: a caller (a test process)
    # gets its CPUs back, so what it starts later is not confined to them.
    own_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server_main, args=(child, server_cpus), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the do-nothing gRPC server did not start within 60 s")
        port = int(parent.recv())
        pin(client_cpus)
        where = sorted(server_cpus or []) or "any", sorted(client_cpus or []) or "any"
        say(
            f"a do-nothing gRPC server on pushkv's contract, CPUs {where[0]}; "
            f"clients on {where[1]}; "
            f"{args.calls} calls per measurement, {args.concurrency} in flight"
        )
        runs: list[dict[str, float]] = []
        for r in range(args.rounds):
            t0 = time.monotonic()
            assert proc.pid is not None
            res = asyncio.run(_measure(port, proc.pid, args.calls, args.concurrency))
            runs.append(res)
            took = time.monotonic() - t0
            say(
                f"round {r + 1}: server CPU per unary Submit "
                + ", ".join(f"{k} call(s) {res[f'unary_{k}']:.0f} µs" for k in BATCHES)
                + f"; per stream message pair {res['stream']:.0f} µs ({took:.1f} s)"
            )
    finally:
        pin(own_cpus)
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    per_core = 1e6 / med["unary_1"] if med["unary_1"] > 0 else float("nan")
    say(
        f"medians of {args.rounds} rounds: a one-call Submit costs the server "
        f"{med['unary_1']:.0f} µs of CPU ({per_core:.0f} RPCs/s per core, nothing else done); "
        f"per call {med['unary_8'] / 8:.0f} µs in 8-call and {med['unary_64'] / 64:.0f} µs "
        f"in 64-call batches; a stream message pair {med['stream']:.0f} µs"
    )
    say(
        f"unary_us={med['unary_1']:.0f} unary_8_calls_us={med['unary_8']:.0f} "
        f"unary_64_calls_us={med['unary_64']:.0f} stream_pair_us={med['stream']:.0f} "
        f"unary_rpcs_per_core={per_core:.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
