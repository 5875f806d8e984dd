"""The load generator of `pushkv bench coordinator`: request-client processes.

Each client calls RegisterDecodeBlocks and ReportPrefillDone for every
transfer at a fixed offered rate (open loop: a slow answer does not slow the
offer), the side that goes first picked at random per transfer. The second
call is sent once the first was answered, so it is the one that completes the
rendezvous, and its send time is where order latency starts.

Unbatched: each call is one unary RPC. Batched (`batch` > 0): the client is an
engine pair that, once per scheduler step, submits what became due as a
decode-side and a prefill-side ``Submit`` of at most `batch` calls each (the
prefill-side one of a group sent once the decode-side one was answered, or
the other way round).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from pushkv.bench.coordinator_server import pin
from pushkv.bench.coordinator_workload import RPC_TIMEOUT_S, decode_request, prefill_request


class ClientReport(NamedTuple):
    """One client's part of a step (monotonic times, shared by all processes)."""

    t0: float  # the offer began
    t_end: float  # the last transfer was offered (answers may come later)
    issued: int
    dropped: int  # not offered: the client had --max-outstanding transfers pending
    sent: dict[str, float]  # both calls accepted: tid -> send of the completing call
    errors: dict[str, int]  # status code name -> calls
    rpcs: int  # RPCs sent (unbatched: 2 per transfer)
    calls: int  # calls in them (batched: calls / rpcs = mean Submit size)
    # How late the client's event loop ran a timer during the offer, in ms
    # (pushkv/bench/cluster: the simulated agents' share of the order latency).
    loop_lag_ms: tuple[float, ...] = ()


def client_main(
    conn: Connection, address: str, client_id: int, cpus: set[int] | None, batch: int
) -> None:
    """Process entry: serve the controller's "run" and "fill" commands until "quit"."""
    pin(cpus)
    asyncio.run(_client(conn, address, client_id, batch))


async def _client(conn: Connection, address: str, client_id: int, batch: int) -> None:
    import grpc

    from pushkv.v1 import pushkv_pb2 as pb
    from pushkv.v1 import pushkv_pb2_grpc as pbg

    channel: Any = grpc.aio.insecure_channel(address)
    stub: Any = pbg.TransferServiceStub(channel)
    rng = random.Random(client_id)
    code_name = {c.value[0]: c.name for c in grpc.StatusCode}
    sent: dict[str, float] = {}
    errors: dict[str, int] = {}
    first_detail: dict[str, str] = {}
    counts = [0, 0]  # RPCs, calls

    def error(code: str, detail: str) -> None:
        errors[code] = errors.get(code, 0) + 1
        first_detail.setdefault(code, detail)

    def rpc_error(exc: Any) -> None:
        error(exc.code().name, f"{exc.details()} {exc.debug_error_string()}")

    async def register(tid: str) -> None:
        counts[0] += 1
        counts[1] += 1
        await stub.RegisterDecodeBlocks(decode_request(tid), timeout=RPC_TIMEOUT_S)

    async def prefill_done(tid: str) -> None:
        counts[0] += 1
        counts[1] += 1
        await stub.ReportPrefillDone(prefill_request(tid), timeout=RPC_TIMEOUT_S)

    async def one(tid: str) -> None:
        """Unbatched: two unary RPCs, the second sent once the first was answered."""
        first, second = (register, prefill_done) if rng.random() < 0.5 else (prefill_done, register)
        try:
            await first(tid)
            t_send = time.monotonic()
            await second(tid)
        except grpc.aio.AioRpcError as exc:
            rpc_error(exc)
            return
        sent[tid] = t_send

    async def submit(calls: list[Any]) -> list[Any]:
        counts[0] += 1
        counts[1] += len(calls)
        resp = await stub.Submit(pb.SubmitRequest(calls=calls), timeout=RPC_TIMEOUT_S)
        return list(resp.results)

    async def many(tids: list[str]) -> None:
        """Batched: a decode engine's and a prefill engine's Submit for these transfers."""
        dec = [pb.TransferCall(register=decode_request(t)) for t in tids]
        pre = [pb.TransferCall(prefill_done=prefill_request(t)) for t in tids]
        first, second = (dec, pre) if rng.random() < 0.5 else (pre, dec)
        try:
            r1 = await submit(first)
            t_send = time.monotonic()
            r2 = await submit(second)
        except grpc.aio.AioRpcError as exc:
            for _ in tids:
                rpc_error(exc)
            return
        for tid, a, b in zip(tids, r1, r2, strict=True):
            bad = a if a.code else b if b.code else None
            if bad is None:
                sent[tid] = t_send
            else:
                error(code_name.get(bad.code, str(bad.code)), bad.message)

    async def offer(prefix: str, rate: float, duration: float, cap: int, step_s: float) -> None:
        """Open loop: `rate` transfers/s for `duration` s, at most `cap` pending."""
        pending: set[asyncio.Task[None]] = set()
        outstanding = [0]
        n = max(1, int(rate * duration))
        t0 = time.monotonic()
        issued = dropped = 0
        while issued + dropped < n:
            due = min(n, int((time.monotonic() - t0) * rate) + 1)
            new: list[str] = []
            while issued + dropped < due:
                i = issued + dropped
                if outstanding[0] + len(new) >= cap:
                    dropped += 1
                    continue
                new.append(f"{prefix}-c{client_id}-{i}")
                issued += 1
            # Unbatched: each transfer's two unary RPCs. Batched: what is due
            # now, in groups of at most `batch` transfers (never waiting).
            groups = [new[i : i + batch] for i in range(0, len(new), batch)] if batch else []
            coros = [many(g) for g in groups] if batch else [one(t) for t in new]
            sizes = [len(g) for g in groups] if batch else [1] * len(new)
            for coro, size in zip(coros, sizes, strict=True):
                task = asyncio.create_task(coro)
                outstanding[0] += size
                pending.add(task)

                def finished(t: asyncio.Task[None], size: int = size) -> None:
                    pending.discard(t)
                    outstanding[0] -= size

                task.add_done_callback(finished)
            next_at = t0 + (issued + dropped) / rate
            # Pacing of the open-loop offer (not synchronisation). Batched, a
            # client is an engine pair: it submits once per scheduler step.
            await asyncio.sleep(max(next_at - time.monotonic(), step_s, 0.0005))
        t_end = time.monotonic()
        if pending:
            await asyncio.wait(pending)
        for code, detail in first_detail.items():
            print(f"client {client_id}: {code}: {detail}", file=sys.stderr, flush=True)
        rpcs, calls = counts
        report = ClientReport(t0, t_end, issued, dropped, dict(sent), dict(errors), rpcs, calls)
        conn.send(report)

    async def fill(prefix: str, count: int, concurrency: int) -> None:
        """Register `count` transfers (decode side only: they stay REGISTERED)."""
        sem = asyncio.Semaphore(concurrency)
        ok = [0]

        async def bounded(tid: str) -> None:
            async with sem:
                try:
                    await register(tid)
                except grpc.aio.AioRpcError as exc:
                    rpc_error(exc)
                    return
                ok[0] += 1

        await asyncio.gather(*(bounded(f"{prefix}-{i}") for i in range(count)))
        conn.send((ok[0], dict(errors)))

    while True:
        cmd = await asyncio.to_thread(conn.recv)
        sent.clear()
        errors.clear()
        first_detail.clear()
        counts[:] = [0, 0]
        if cmd[0] == "run":
            await offer(*cmd[1:])
        elif cmd[0] == "fill":
            await fill(*cmd[1:])
        else:
            break
    await channel.close()
