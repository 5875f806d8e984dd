"""``pushkv bench core --front-hop``: one routed message between a front and a partition.

The partitioned leader (docs/reliability.md, "Past one leader core", not
built) would have front processes that end the agents' streams and pass each
report to its transfer's partition as a protobuf frame on a Unix socket, and
each order back the same way. This measures that hop alone, as it would run:
asyncio streams on a Unix socket, each frame a 4-byte length and the
serialized message, frames coalesced into one write per ``--batch``.

A front (this process) sends ``--n`` TP-8 prefill ranks' DONE reports
(``AgentMessage``, serialized as the front read them from gRPC) to a
partition process; the partition parses each and answers each with one
order (a TP-8 rank's ``CoordinatorMessage``, filled and serialized), which
the front parses. The figures are each side's CPU (process time) per message
pair and the round trips per wall-clock second. The baseline, in the same
run: the same parse and serialize work in one process, no socket, which is
what the state machine's process does today.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TextIO

from pushkv.bench.children import reap
from pushkv.net.frames import HEADER, READ_CHUNK, take_frames

TP = 8
DEADLINE_S = 120.0  # every wait of the run


def _report(i: int) -> bytes:
    from pushkv.v1 import pushkv_pb2 as pb

    return pb.AgentMessage(
        write=pb.WriteReport(
            order_id=f"o-{i}-3",
            transfer_id=f"tx-bench-{i:012d}",
            status=pb.WRITE_STATUS_DONE,
            bytes=3 * 2 * 4096,
            descriptors=6,
        )
    ).SerializeToString()


def _order(transfer_id: str, out: Any) -> bytes:
    """A TP-8 prefill rank's order for `transfer_id` (one decode rank, 3 blocks)."""
    o = out.order
    o.Clear()
    o.order_id = transfer_id + "-3"
    o.transfer_id = transfer_id
    o.prefill_rank = 3
    o.prefill_incarnation = "b1"
    t = o.targets.add()
    t.decode_engine_id, t.decode_rank, t.decode_incarnation = "bench-d", 3, "b1"
    t.src_blocks.add().ids.extend((1, 2, 3))
    t.dst_blocks.add().ids.extend((7, 8, 9))
    t.expected_writers = 1
    o.deadline_unix_ms, o.num_tokens, o.term = 1_900_000_000_000, 40, 7
    data: bytes = out.SerializeToString()
    return data


async def _serve(path: str, ready: Connection) -> None:
    """The partition: parse each report, answer each with an order; an empty
    frame asks for the CPU it spent since the first report."""
    from pushkv.v1 import pushkv_pb2 as pb

    done = asyncio.Event()
    parse = pb.AgentMessage.FromString
    scratch = pb.CoordinatorMessage()

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf = bytearray()
        cpu0 = -1.0
        while chunk := await reader.read(READ_CHUNK):
            buf += chunk
            out = []
            for frame in take_frames(buf):
                if cpu0 < 0:
                    cpu0 = time.process_time()
                if not frame:  # the end: the CPU spent, then close
                    spent = struct.pack(">d", time.process_time() - cpu0)
                    writer.write(HEADER.pack(len(spent)) + spent)
                    await writer.drain()
                    writer.close()
                    done.set()
                    return
                msg = parse(frame)
                body = _order(msg.write.transfer_id, scratch)
                out.append(HEADER.pack(len(body)))
                out.append(body)
            if out:
                writer.write(b"".join(out))
                await writer.drain()

    server = await asyncio.start_unix_server(conn, path)
    ready.send(True)
    async with server:
        await asyncio.wait_for(done.wait(), DEADLINE_S)


def _partition(path: str, ready: Connection) -> None:
    asyncio.run(_serve(path, ready))


@dataclass(frozen=True)
class HopRep:
    n: int
    front_cpu_s: float
    partition_cpu_s: float
    wall_s: float
    in_process_cpu_s: float  # the baseline: the same parse/serialize, no socket

    @property
    def front_us(self) -> float:
        return self.front_cpu_s / self.n * 1e6

    @property
    def partition_us(self) -> float:
        return self.partition_cpu_s / self.n * 1e6

    @property
    def in_process_us(self) -> float:
        return self.in_process_cpu_s / self.n * 1e6


async def _front(path: str, reports: Sequence[bytes], batch: int) -> tuple[float, float, float]:
    """Send every report, read every order; (front CPU, partition CPU, wall)."""
    from pushkv.v1 import pushkv_pb2 as pb

    reader, writer = await asyncio.open_unix_connection(path)
    parse = pb.CoordinatorMessage.FromString
    want = len(reports)

    async def send() -> None:
        for i in range(0, want, batch):
            writer.write(b"".join(HEADER.pack(len(r)) + r for r in reports[i : i + batch]))
            await writer.drain()

    t0, cpu0 = time.monotonic(), time.process_time()
    sender = asyncio.create_task(send())
    buf, got, spent = bytearray(), 0, -1.0
    wall = cpu = 0.0
    while spent < 0:
        chunk = await reader.read(READ_CHUNK)
        if not chunk:
            raise RuntimeError(f"the partition closed after {got} of {want} orders")
        buf += chunk
        for frame in take_frames(buf):
            if got < want:
                if not parse(frame).order.transfer_id:
                    raise RuntimeError("an order without its transfer")
                got += 1
                if got == want:
                    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
                    writer.write(HEADER.pack(0))  # the end
                    await writer.drain()
            else:
                (spent,) = struct.unpack(">d", frame)
    await sender
    writer.close()
    return cpu, spent, wall


def _in_process(reports: Sequence[bytes]) -> float:
    """CPU of the same parse/serialize work with no socket."""
    from pushkv.v1 import pushkv_pb2 as pb

    parse_in, parse_out = pb.AgentMessage.FromString, pb.CoordinatorMessage.FromString
    scratch = pb.CoordinatorMessage()
    cpu0 = time.process_time()
    for r in reports:
        parse_out(_order(parse_in(r).write.transfer_id, scratch))
    return time.process_time() - cpu0


def one_rep(n: int, batch: int) -> HopRep:
    reports = [_report(i) for i in range(n)]
    base = _in_process(reports)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pushkv-hop-") as d:
        path = os.path.join(d, "partition.sock")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_partition, args=(path, send))
        proc.start()
        send.close()
        try:
            if not recv.poll(DEADLINE_S):
                raise TimeoutError("the partition process did not start")
            recv.recv()
            front, part, wall = asyncio.run(
                asyncio.wait_for(_front(path, reports, batch), DEADLINE_S)
            )
        finally:
            reap([proc], DEADLINE_S)
    if proc.exitcode != 0:
        raise RuntimeError(f"the partition process failed (exit code {proc.exitcode})")
    return HopRep(n, front, part, wall, base)


def report(reps: Sequence[HopRep], batch: int, out: TextIO | Any = sys.stdout) -> float:
    """Print each repetition and the medians; returns the median added CPU
    (front + partition - in process) per message pair, in microseconds."""
    for i, r in enumerate(reps):
        out.write(
            f"  rep {i + 1}: front {r.front_us:6.2f} us, partition {r.partition_us:6.2f} us, "
            f"in one process {r.in_process_us:6.2f} us per report+order; "
            f"{r.n / r.wall_s:8.0f} round trips/s\n"
        )
    front = statistics.median(r.front_us for r in reps)
    part = statistics.median(r.partition_us for r in reps)
    base = statistics.median(r.in_process_us for r in reps)
    rate = statistics.median(r.n / r.wall_s for r in reps)
    added = statistics.median(r.front_us + r.partition_us - r.in_process_us for r in reps)
    out.write(
        f"front_hop: batch={batch} front_us={front:.2f} partition_us={part:.2f} "
        f"in_process_us={base:.2f} added_us={added:.2f} round_trips_per_s={rate:.0f}\n"
    )
    return added
