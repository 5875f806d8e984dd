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

Two such servers run side by side, one on asyncio's event loop and one on
uvloop's (`pushkv coordinator --event-loop`, whose default is uvloop), and
each round measures both, in turns (the first of a round alternates). Each
measurement: unary ``Submit`` carrying 1, 8 and 64 calls (``--concurrency``
in flight, as many engines' scheduler clients would), then stream message
pairs (one up, one down) on one ``AgentStream``. The medians of
``--rounds`` rounds are printed, and uvloop's over asyncio's. The final line
(one line; folded here), uvloop's figures first:

    unary_us=<u> stream_pair_us=<s> unary_us_asyncio=<ua> stream_pair_us_asyncio=<sa>
    uvloop_unary_ratio=<ru> uvloop_stream_ratio=<rs>
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

from pushkv.bench.children import reap
from pushkv.bench.coordinator_server import cpu_seconds, cpu_split, pin
from pushkv.bench.output import say

BATCHES = (1, 8, 64)  # calls per Submit
LOOPS = ("asyncio", "uvloop")  # the event loops measured (the servers' --event-loop)


def _server_main(conn: Connection, cpus: set[int] | None, event_loop: str) -> None:
    """Process entry: serve the do-nothing servicers on `event_loop` (as
    `pushkv coordinator --event-loop`) until the controller says "stop"."""
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

    if event_loop == "uvloop":
        import uvloop

        uvloop.run(run())
    else:
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


def _start_server(ctx: Any, cpus: set[int] | None, event_loop: str) -> tuple[Any, Any, int]:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server_main, args=(child, cpus, event_loop), daemon=True)
    proc.start()
    if not parent.poll(60):
        proc.kill()
        raise RuntimeError(f"the do-nothing gRPC server ({event_loop}) did not start within 60 s")
    return proc, parent, int(parent.recv())


def _line(res: dict[str, float]) -> str:
    return (
        ", ".join(f"{k} call(s) {res[f'unary_{k}']:.0f} µs" for k in BATCHES)
        + f"; stream message pair {res['stream']:.0f} µs"
    )


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
    servers: dict[str, tuple[Any, Any, int]] = {}
    runs: dict[str, list[dict[str, float]]] = {loop: [] for loop in LOOPS}
    try:
        for loop in LOOPS:
            servers[loop] = _start_server(ctx, server_cpus, loop)
        pin(client_cpus)
        where = sorted(server_cpus or []) or "any", sorted(client_cpus or []) or "any"
        say(
            f"do-nothing gRPC servers on pushkv's contract ({' and '.join(LOOPS)} event "
            f"loops, measured in turn), CPUs {where[0]}; clients on {where[1]}; "
            f"{args.calls} calls per measurement, {args.concurrency} in flight"
        )
        for r in range(args.rounds):
            # Alternate which loop goes first, so that neither always has the quieter half.
            for loop in LOOPS if r % 2 == 0 else LOOPS[::-1]:
                proc, _, port = servers[loop]
                t0 = time.monotonic()
                res = asyncio.run(_measure(port, proc.pid, args.calls, args.concurrency))
                runs[loop].append(res)
                took = time.monotonic() - t0
                say(f"round {r + 1} {loop:>7}: server CPU per Submit {_line(res)} ({took:.1f} s)")
    finally:
        pin(own_cpus)
        for _proc, conn, _ in servers.values():
            conn.send("stop")
        reap([proc for proc, _, _ in servers.values()], 10)
    med = {
        loop: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for loop, rs in runs.items()
    }
    a, u = med["asyncio"], med["uvloop"]
    for loop, m in med.items():
        per_core = 1e6 / m["unary_1"] if m["unary_1"] > 0 else float("nan")
        say(
            f"{loop}, medians of {args.rounds} rounds: a one-call Submit costs the server "
            f"{m['unary_1']:.0f} µs of CPU ({per_core:.0f} RPCs/s per core, nothing else "
            f"done); per call {m['unary_8'] / 8:.0f} µs in 8-call and "
            f"{m['unary_64'] / 64:.0f} µs in 64-call batches; a stream message pair "
            f"{m['stream']:.0f} µs"
        )

    def ratio(k: str) -> float:
        return u[k] / a[k] if a[k] > 0 else float("nan")

    say(
        f"uvloop / asyncio, server CPU: one-call Submit {ratio('unary_1'):.2f}, "
        f"stream message pair {ratio('stream'):.2f}"
    )
    say(
        f"unary_us={u['unary_1']:.0f} stream_pair_us={u['stream']:.0f} "
        f"unary_us_asyncio={a['unary_1']:.0f} stream_pair_us_asyncio={a['stream']:.0f} "
        f"uvloop_unary_ratio={ratio('unary_1'):.2f} uvloop_stream_ratio={ratio('stream'):.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
