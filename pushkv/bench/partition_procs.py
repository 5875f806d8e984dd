"""``pushkv bench core --procs K``: the state machine in K partition processes.

Step 2 of the partitioned leader (docs/reliability.md, "Past one leader
core"): each partition is a process of its own (controlplane/partition_host.py)
fed over a Unix socket in length-prefixed frames, and the front
(controlplane/front.py) serves a node relay's NodeStream through them. This
process holds the front and plays one relay carrying the agents of one engine
pair at TP `--tp` (one channel per rank, as `pushkv bench core` has one
session per rank):

- each rank's hello goes up its channel (the front sends it to every
  partition, and passes one welcome down);
- each batch of `--batch` transfers is two relayed `Submit`s (the decode
  registrations, then the prefill reports; the front sends each call to its
  transfer's partition and puts the answers back in order);
- each order that comes down is answered at once: POSTED and DONE from its
  prefill rank, the arrival from its decode rank, one NodeUp per NodeDown read.

At the end every transfer is asked for with a cancel, answered with its
state: each must be COMPLETE, each order named by its transfer's partition,
once per prefill rank.

Figures: CPU per TP-N rendezvous of each tier (the partitions from
/proc/PID/stat, 10 ms ticks; this process from its own process time: the
front and the simulated relay and agents together) and the rate. The
baseline, in the same run: one Runtime in this process with no socket and no
front (`pushkv bench core`'s repetition), thread CPU per rendezvous.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from pushkv.bench.coordinator_server import cpu_seconds
from pushkv.bench.coordinator_workload import (
    CORE_SETTINGS,
    DECODE,
    PREFILL,
    agent_hello,
    decode_request,
    prefill_request,
)
from pushkv.v1 import pushkv_pb2 as pb

DEADLINE_S = 120.0  # every wait of a run
MAX_CALLS = 1024  # a Submit's most calls (controlplane/servicers.py)
COORDINATOR_ID = "bench"


@dataclass
class ProcsRun:
    k: int
    n: int
    tp: int
    wall_s: float
    front_cpu_s: float
    partition_cpu_s: list[float]
    states: Counter[str] = field(default_factory=Counter)
    welcomes: int = 0
    # orders from a partition other than their transfer's, or not named by it
    misrouted: int = 0
    repeated: int = 0  # a prefill rank ordered twice for one transfer
    order_terms: set[int] = field(default_factory=set)

    @property
    def rate(self) -> float:
        return self.n / self.wall_s

    @property
    def front_us(self) -> float:
        return self.front_cpu_s / self.n * 1e6

    @property
    def partitions_us(self) -> float:
        return sum(self.partition_cpu_s) / self.n * 1e6


class Relay:
    """A node relay carrying the agents of one engine pair, on one NodeStream
    served by the front (controlplane/front.py) over K partitions."""

    def __init__(self, k: int, tp: int, run: ProcsRun) -> None:
        from pushkv.controlplane.partitions import partition_of

        self._k = k
        self._of = partition_of
        self._tp = tp
        self._run = run
        self._up: asyncio.Queue[pb.NodeUp | None] = asyncio.Queue()
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[pb.SubmitResponse]] = {}
        self._all_welcomed = asyncio.Event()
        self._ordered: set[tuple[str, int]] = set()
        self._want_orders = 0
        self._all_ordered = asyncio.Event()
        self._broken: list[str] = []

    # channels: prefill rank r is r + 1, decode rank r is tp + r + 1
    def _prefill_channel(self, rank: int) -> int:
        return rank + 1

    def _decode_channel(self, rank: int) -> int:
        return self._tp + rank + 1

    async def requests(self) -> AsyncIterator[pb.NodeUp]:
        while (up := await self._up.get()) is not None:
            yield up

    def end(self) -> None:
        self._up.put_nowait(None)

    async def read(self, downs: AsyncIterator[pb.NodeDown]) -> None:
        """The front's NodeDowns: welcomes, Submit answers, orders."""
        async for down in downs:
            up = pb.NodeUp()
            writes: dict[int, list[pb.AgentMessage]] = {}
            arrivals: dict[int, list[pb.AgentMessage]] = {}
            for item in down.items:
                if item.HasField("submitted"):
                    r = item.submitted
                    fut = self._replies.pop(r.id)
                    if r.code:
                        fut.set_exception(RuntimeError(f"Submit failed: {r.code} {r.detail}"))
                    else:
                        fut.set_result(r.response)
                    continue
                if item.ended:
                    self._broken.append(f"channel {item.channel} ended: {item}")
                    self._all_welcomed.set()
                    self._all_ordered.set()
                    continue
                m = item.message
                for msg in m.batch.messages if m.WhichOneof("kind") == "batch" else (m,):
                    kind = msg.WhichOneof("kind")
                    if kind == "welcome":
                        self._run.welcomes += 1
                        if self._run.welcomes == 2 * self._tp:
                            self._all_welcomed.set()
                    elif kind == "order":
                        self._on_order(msg.order, writes, arrivals)
            for channel, batch in itertools.chain(writes.items(), arrivals.items()):
                up.items.add(
                    channel=channel, message=pb.AgentMessage(batch=pb.AgentBatch(messages=batch))
                )
            if up.items:
                self._up.put_nowait(up)

    def _on_order(
        self,
        o: pb.TransferOrder,
        writes: dict[int, list[pb.AgentMessage]],
        arrivals: dict[int, list[pb.AgentMessage]],
    ) -> None:
        run = self._run
        if not o.order_id.startswith(f"{COORDINATOR_ID}.{self._of(o.transfer_id, self._k)}-"):
            run.misrouted += 1  # named by another partition than its transfer's
        key = (o.transfer_id, o.prefill_rank)
        if key in self._ordered:
            run.repeated += 1
        self._ordered.add(key)
        run.order_terms.add(o.term)
        w = writes.setdefault(self._prefill_channel(o.prefill_rank), [])
        for st in (pb.WRITE_STATUS_POSTED, pb.WRITE_STATUS_DONE):
            w.append(
                pb.AgentMessage(
                    write=pb.WriteReport(order_id=o.order_id, transfer_id=o.transfer_id, status=st)
                )
            )
        for t in o.targets:
            arrivals.setdefault(self._decode_channel(t.decode_rank), []).append(
                pb.AgentMessage(
                    arrival=pb.ArrivalReport(
                        transfer_id=o.transfer_id, prefill_ranks=[o.prefill_rank]
                    )
                )
            )
        if len(self._ordered) >= self._want_orders:
            self._all_ordered.set()

    def hellos(self) -> None:
        """Every rank's hello, each on its channel."""
        up = pb.NodeUp()
        for r in range(self._tp):
            for channel, engine, role in (
                (self._prefill_channel(r), PREFILL, pb.ROLE_PREFILL),
                (self._decode_channel(r), DECODE, pb.ROLE_DECODE),
            ):
                hello = agent_hello(engine, role, batched=True, rank=r, tp=self._tp)
                up.items.add(channel=channel, message=pb.AgentMessage(hello=hello))
        self._up.put_nowait(up)

    async def welcomed(self) -> None:
        await asyncio.wait_for(self._all_welcomed.wait(), DEADLINE_S)
        if self._broken:
            raise RuntimeError(self._broken[0])

    def _submit(self, calls: list[pb.TransferCall]) -> asyncio.Future[pb.SubmitResponse]:
        rid = next(self._ids)
        fut: asyncio.Future[pb.SubmitResponse] = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        item = pb.ChannelUp(submit=pb.RelayedSubmit(id=rid, request=pb.SubmitRequest(calls=calls)))
        self._up.put_nowait(pb.NodeUp(items=[item]))
        return fut

    async def rendezvous(self, tids: Sequence[str], batch: int) -> None:
        """Both sides of every transfer, `batch` transfers at a time (each
        side one Submit, as an engine's scheduler batches them); returns once
        every prefill rank of every one was ordered and its reports applied."""
        self._want_orders = len(tids) * self._tp
        for start in range(0, len(tids), batch):
            chunk = tids[start : start + batch]
            waits = [
                self._submit([pb.TransferCall(register=decode_request(t)) for t in chunk]),
                self._submit([pb.TransferCall(prefill_done=prefill_request(t)) for t in chunk]),
            ]
            for answer in await asyncio.wait_for(asyncio.gather(*waits), DEADLINE_S):
                bad = [r for r in answer.results if r.code]
                if bad:
                    raise RuntimeError(f"a side refused: {bad[0]}")
        await asyncio.wait_for(self._all_ordered.wait(), DEADLINE_S)
        if self._broken:
            raise RuntimeError(self._broken[0])
        # A barrier: a cancel of an unknown transfer in each partition is
        # answered (NOT_FOUND) after the reports sent there before it applied.
        await asyncio.wait_for(self._submit(self._barrier()), DEADLINE_S)

    def _barrier(self) -> list[pb.TransferCall]:
        ids = (f"barrier-{j}" for j in itertools.count())
        firsts: dict[int, str] = {}
        for t in ids:
            firsts.setdefault(self._of(t, self._k), t)
            if len(firsts) == self._k:
                break
        return [
            pb.TransferCall(cancel=pb.CancelRequest(transfer_id=t, reason="bench: barrier"))
            for t in firsts.values()
        ]

    async def states(self, tids: Sequence[str]) -> Counter[str]:
        """Each transfer's state, asked for with a cancel (after the reports on
        the same stream: answered once they applied)."""
        waits = []
        for start in range(0, len(tids), MAX_CALLS):
            calls = [
                pb.TransferCall(cancel=pb.CancelRequest(transfer_id=t, reason="bench: asked"))
                for t in tids[start : start + MAX_CALLS]
            ]
            waits.append(self._submit(calls))
        out: Counter[str] = Counter()
        for answer in await asyncio.wait_for(asyncio.gather(*waits), DEADLINE_S):
            for r in answer.results:
                out[pb.TransferState.Name(r.state) if not r.code else f"error {r.code}"] += 1
        return out


async def run_procs(
    k: int, n: int, tp: int, batch: int, *, term: int = 0, prefix: str = "p"
) -> ProcsRun:
    """One run: K partition processes started, n TP-`tp` rendezvous through
    them, every transfer's state asked for, the processes stopped."""
    from pushkv.controlplane.front import PartitionFront
    from pushkv.controlplane.partition_link import PartitionProcess
    from pushkv.controlplane.settings import CoreSettings

    settings = CoreSettings(**CORE_SETTINGS)
    run = ProcsRun(k, n, tp, 0.0, 0.0, [0.0] * k)
    with tempfile.TemporaryDirectory(prefix="pushkv-partitions-") as d:
        parts: list[Any] = []
        codes: list[int] = []
        try:
            for i in range(k):
                parts.append(
                    await PartitionProcess.start(
                        d, i, k, term=term, coordinator_id=COORDINATOR_ID, settings=settings
                    )
                )
            front = PartitionFront(parts)
            front.start()
            relay = Relay(k, tp, run)
            reader = asyncio.create_task(relay.read(front.stream("bench").serve(relay.requests())))
            try:
                relay.hellos()
                await relay.welcomed()
                tids = [f"{prefix}-{i}" for i in range(n)]
                cpu0 = [cpu_seconds(p.proc.pid) for p in parts]
                t0, f0 = time.monotonic(), time.process_time()
                await relay.rendezvous(tids, batch)
                run.wall_s = time.monotonic() - t0
                run.front_cpu_s = time.process_time() - f0
                run.partition_cpu_s = [
                    cpu_seconds(p.proc.pid) - c for p, c in zip(parts, cpu0, strict=True)
                ]
                run.states = await relay.states(tids)
            finally:
                relay.end()
                await asyncio.wait_for(reader, DEADLINE_S)
                await front.stop()
        finally:
            codes = [await p.close() for p in parts]
    if any(codes):
        raise RuntimeError(f"partition exit codes {codes}")
    return run


def baseline_us(n: int, tp: int, batch: int) -> float:
    """One in-process Runtime's thread CPU per rendezvous (`pushkv bench core`)."""
    from pushkv.bench.coordinator_core import _one_rep

    phases = asyncio.run(_one_rep(n, batch, False, 0, tp))
    return sum(phases.values())


def report(runs: dict[int, list[ProcsRun]], base: list[float], out: TextIO | None = None) -> None:
    out = out or sys.stdout  # read now: a test's capture replaces it
    b = statistics.median(base)
    for k, rs in sorted(runs.items()):
        for i, r in enumerate(rs):
            out.write(
                f"  K={k} rep {i + 1}: {r.rate:8.0f} rendezvous/s, partitions "
                f"{r.partitions_us:7.1f} us, front+agents {r.front_us:7.1f} us per rendezvous "
                f"({', '.join(f'{s:.2f}' for s in r.partition_cpu_s)} s each); {dict(r.states)}\n"
            )
        rate = statistics.median(r.rate for r in rs)
        part = statistics.median(r.partitions_us for r in rs)
        front = statistics.median(r.front_us for r in rs)
        out.write(
            f"procs: k={k} tp={rs[0].tp} rendezvous_per_s={rate:.0f} partitions_us={part:.1f} "
            f"front_us={front:.1f} in_process_us={b:.1f} partitions_over_in_process="
            f"{part / b:.2f}\n"
        )
