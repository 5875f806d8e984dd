"""The simulated agents of `pushkv bench coordinator`: one process hosting both
agent streams of the 1-prefill + 1-decode engine pair (TP 1). They move no
bytes: on every order the prefill stream reports POSTED and DONE at once, and
the decode stream reports the arrival of the rank it was written by.

What counts as COMPLETE (`Ledger`). A clean COMPLETE sends no notice, so a
transfer counts as COMPLETE once the coordinator has applied both its DONE
(prefill stream) and its arrival (decode stream), and no notice said it
failed: the coordinator handles a stream's messages in order, so the ack of a
heartbeat sent after a report proves the report was applied (at most one such
barrier per stream every `CONFIRM_PERIOD_S`). A notice with
``write_may_land=False`` records the state it names instead (FAILED,
CANCELLED, EXPIRED), and that record wins over a confirmation. When the
controller collects a step, a sample of the transfers counted COMPLETE is
checked against the coordinator's own state (GetTransfer).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from pushkv.bench.coordinator_server import pin
from pushkv.bench.coordinator_workload import COMPLETE, DECODE, PREFILL, RPC_TIMEOUT_S, agent_hello

CONFIRM_PERIOD_S = 0.01  # at most one barrier heartbeat per stream per period
SPOT_CHECK = 16  # transfers counted COMPLETE asked back from the coordinator, per collect


@dataclass
class Ledger:
    """Per transfer id: when its order arrived and how it ended (monotonic times)."""

    ordered: dict[str, float] = field(default_factory=dict)
    confirmed: dict[str, float] = field(default_factory=dict)  # both final reports applied
    failed: dict[str, tuple[float, int]] = field(default_factory=dict)  # (when, state)
    _half: dict[str, float] = field(default_factory=dict)  # one of the two confirmed

    def order(self, tid: str, now: float) -> None:
        self.ordered[tid] = now

    def report_applied(self, tid: str, now: float) -> None:
        """One of the transfer's two final reports (DONE, arrival) was applied."""
        if self._half.pop(tid, None) is None:
            self._half[tid] = now
        else:
            self.confirmed[tid] = now

    def fail(self, tid: str, now: float, state: int) -> None:
        """A notice said no WRITE can land any more: the transfer ended in `state`."""
        self.failed[tid] = (now, state)

    def ended(self, prefix: str) -> int:
        """How many transfers of `prefix` ended, either way (each counted once)."""
        done = sum(1 for k in self.confirmed if k.startswith(prefix) and k not in self.failed)
        return done + sum(1 for k in self.failed if k.startswith(prefix))

    def collect(self, prefix: str) -> tuple[dict[str, float], dict[str, tuple[float, int]]]:
        """Remove and return the transfers of `prefix`: (order receipt times,
        (end time, end state)); a failure notice wins over a confirmation."""
        ordered = {k: v for k, v in self.ordered.items() if k.startswith(prefix)}
        ends = {k: (t, COMPLETE) for k, t in self.confirmed.items() if k.startswith(prefix)}
        ends.update({k: v for k, v in self.failed.items() if k.startswith(prefix)})
        for k in ordered:
            del self.ordered[k]
        for k in ends:
            self.confirmed.pop(k, None)
            self.failed.pop(k, None)
        for k in [k for k in self._half if k.startswith(prefix)]:
            del self._half[k]
        return ordered, ends


def agents_main(conn: Connection, address: str, cpus: set[int] | None, batched: bool) -> None:
    """Process entry: serve the controller's commands until "quit"."""
    pin(cpus)
    asyncio.run(_agents(conn, address, batched))


async def _agents(conn: Connection, address: str, batched: bool) -> None:
    import grpc

    from pushkv.v1 import pushkv_pb2 as pb
    from pushkv.v1 import pushkv_pb2_grpc as pbg

    ledger = Ledger()
    grpc_channel: Any = grpc.aio.insecure_channel(address)
    stub: Any = pbg.AgentServiceStub(grpc_channel)
    status: Any = pbg.StatusServiceStub(grpc_channel)
    eof: Any = grpc.aio.EOF  # type: ignore[attr-defined]
    pre, dec = stub.AgentStream(), stub.AgentStream()

    class Stream:
        def __init__(self, call: Any) -> None:
            self.call = call
            self.lock = asyncio.Lock()
            self.unconfirmed: list[str] = []  # tids whose final report went out
            self.waiting: dict[int, list[str]] = {}  # heartbeat seq -> tids it confirms
            self.wake = asyncio.Event()
            self.seq = 0

        async def send(self, msgs: list[Any], final: list[str]) -> None:
            async with self.lock:
                if batched and len(msgs) > 1:
                    await self.call.write(pb.AgentMessage(batch=pb.AgentBatch(messages=msgs)))
                else:
                    for m in msgs:
                        await self.call.write(m)
                self.unconfirmed += final
            if final:
                self.wake.set()

        def acked(self, seq: int) -> None:
            now = time.monotonic()
            for tid in self.waiting.pop(seq, ()):
                ledger.report_applied(tid, now)
            self.wake.set()

        async def confirm_loop(self) -> None:
            while True:
                await self.wake.wait()
                self.wake.clear()
                if self.waiting or not self.unconfirmed:
                    continue  # one barrier in flight at a time
                self.seq += 1
                async with self.lock:
                    self.waiting[self.seq], self.unconfirmed = self.unconfirmed, []
                    await self.call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=self.seq)))
                await asyncio.sleep(CONFIRM_PERIOD_S)  # pacing of the barriers

    sp, sd = Stream(pre), Stream(dec)
    for s, engine, role in ((sp, PREFILL, pb.ROLE_PREFILL), (sd, DECODE, pb.ROLE_DECODE)):
        await s.call.write(pb.AgentMessage(hello=agent_hello(engine, role, batched=batched)))
    for call in (pre, dec):
        first = await call.read()
        assert first.WhichOneof("kind") == "welcome", first

    def items(msg: Any) -> Any:
        return msg.batch.messages if msg.WhichOneof("kind") == "batch" else (msg,)

    async def prefill_loop() -> None:
        while True:
            msg = await pre.read()
            if msg is eof:
                return
            reports: list[Any] = []
            arrivals: list[Any] = []
            tids: list[str] = []
            now = time.monotonic()  # receipt of this coordinator message
            for m in items(msg):
                kind = m.WhichOneof("kind")
                if kind == "heartbeat_ack":
                    sp.acked(m.heartbeat_ack.seq)
                if kind != "order":
                    continue
                o = m.order
                ledger.order(o.transfer_id, now)
                for st in (pb.WRITE_STATUS_POSTED, pb.WRITE_STATUS_DONE):
                    w = pb.WriteReport(order_id=o.order_id, transfer_id=o.transfer_id, status=st)
                    reports.append(pb.AgentMessage(write=w))
                a = pb.ArrivalReport(transfer_id=o.transfer_id, prefill_ranks=[o.prefill_rank])
                arrivals.append(pb.AgentMessage(arrival=a))
                tids.append(o.transfer_id)
            if tids:
                await sp.send(reports, tids)
                await sd.send(arrivals, tids)

    async def decode_loop() -> None:
        while True:
            msg = await dec.read()
            if msg is eof:
                return
            for m in items(msg):
                kind = m.WhichOneof("kind")
                if kind == "heartbeat_ack":
                    sd.acked(m.heartbeat_ack.seq)
                elif kind == "notice" and not m.notice.write_may_land:
                    ledger.fail(m.notice.transfer_id, time.monotonic(), m.notice.state)

    async def heartbeats() -> None:
        while True:
            await asyncio.sleep(1.0)  # lease keep-alive period
            for s in (sp, sd):
                async with s.lock:  # seq 0 is never a barrier
                    await s.call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=0)))

    async def spot_check(ends: dict[str, tuple[float, int]]) -> tuple[int, int]:
        """(asked, not COMPLETE per the coordinator) over a sample counted COMPLETE."""
        counted = sorted(k for k, (_, s) in ends.items() if s == COMPLETE)
        sample = random.Random(len(counted)).sample(counted, min(SPOT_CHECK, len(counted)))
        wrong = 0
        for tid in sample:
            try:
                t = await status.GetTransfer(
                    pb.GetTransferRequest(transfer_id=tid), timeout=RPC_TIMEOUT_S
                )
            except grpc.aio.AioRpcError:
                wrong += 1  # not even found: not confirmed COMPLETE
                continue
            wrong += t.state != pb.TRANSFER_STATE_COMPLETE
        return len(sample), wrong

    tasks = [
        asyncio.create_task(c())
        for c in (prefill_loop, decode_loop, heartbeats, sp.confirm_loop, sd.confirm_loop)
    ]
    conn.send("ready")
    live_states = [
        pb.TRANSFER_STATE_AWAITING,
        pb.TRANSFER_STATE_REGISTERED,
        pb.TRANSFER_STATE_PREFILL_DONE,
        pb.TRANSFER_STATE_ORDERED,
        pb.TRANSFER_STATE_WRITING,
    ]
    while True:
        cmd = await asyncio.to_thread(conn.recv)
        if cmd[0] == "collect":
            ordered, ends = ledger.collect(cmd[1])
            conn.send((ordered, ends, await spot_check(ends)))
        elif cmd[0] == "count":
            conn.send(ledger.ended(cmd[1]))
        elif cmd[0] == "live":  # transfers not yet terminal, per the coordinator
            r = await status.ListTransfers(
                pb.ListTransfersRequest(states=live_states, limit=1), timeout=RPC_TIMEOUT_S
            )
            conn.send(int(r.total_matching))
        else:
            break
    for t in tasks:
        t.cancel()
    for call in (pre, dec):
        call.cancel()
    await grpc_channel.close()
