"""``pushkv bench coordinator``: rendezvous throughput, order latency and memory per transfer.

Processes (multiprocessing "spawn"; nothing gRPC lives in this controller):

* coordinator: the real gRPC server, pinned to CPU 0 when the host has more
  than one, so the numbers describe "one core";
* agents: one process hosting both agent streams of a 1-prefill + 1-decode
  engine pair (TP 1).  On every order the prefill stream reports POSTED and
  DONE and the decode stream reports arrival of the rank it was written by;
* clients: ``--clients`` processes calling RegisterDecodeBlocks and
  ReportPrefillDone for each transfer, both issued at once in random order, at
  a fixed offered rate (open loop: a slow answer does not slow the offer).

Two runs, each on a fresh coordinator: unbatched (the unary RPCs, one stream
message per report) and batched (``--batch``: each client submits what became
due once per ``--step-ms``, like an engine's scheduler step, as Submit calls;
the agents accept CoordinatorBatch and send one AgentBatch per coordinator
message they handled).

A clean COMPLETE sends no notice, so a transfer counts as completed when the
coordinator has applied both its DONE and its arrival: it handles a stream's
messages in order, so the ack of a heartbeat sent after a report proves the
report was applied (at most one such barrier per stream every 10 ms). Failed
transfers still get a notice; "drained" also asks the coordinator that no
transfer is left unfinished.

The offered rate rises step by step until the coordinator saturates (completed
rendezvous/s fall below 90 % of the offer, or the backlog does not drain).
"Order latency" is measured at half the saturation rate: from the moment the
later of the two arrival RPCs returned to the client, to the moment the order
reached the prefill agent (CLOCK_MONOTONIC is shared by all processes; a
negative value means the order beat the RPC answer).  Finally a fresh
coordinator holds ``--inflight`` transfers in REGISTERED and its VmRSS growth
is divided by their number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

PREFILL, DECODE = "bench-p", "bench-d"
TOKENS = 40  # 3 blocks of 16 tokens on both sides
CORE_SETTINGS: dict[str, Any] = {
    "max_inflight": 1_000_000,
    "max_inflight_per_engine": 1_000_000,
    "rendezvous_timeout_s": 600.0,
    "write_timeout_s": 600.0,
    "retention_s": 30.0,
}
SATURATED = 0.9  # completed/offered below this ratio = saturated
RPC_TIMEOUT_S = 60.0


def _pin(cpus: set[int] | None) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


def _cpu_split() -> tuple[set[int] | None, set[int] | None]:
    """(coordinator CPUs, load CPUs): CPU 0 alone for the coordinator if possible."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


def _quiet_logs() -> None:
    from controlplane import logs

    logs.configure("WARNING", json=True)


# ============================================================ coordinator process


def _coordinator_main(conn: Connection, cpus: set[int] | None, profile: str | None) -> None:
    _pin(cpus)
    _quiet_logs()
    from controlplane.server import ServerSettings, start, tune_gc
    from controlplane.settings import CoreSettings

    tune_gc()  # as `pushkv coordinator` does

    async def run() -> None:
        coord = await start(ServerSettings(port=0, core=CoreSettings(**CORE_SETTINGS)))
        conn.send(coord.port)
        await asyncio.to_thread(conn.recv)  # "stop"
        await coord.stop(0)

    if profile:
        prof = cProfile.Profile()
        prof.enable()
        try:
            asyncio.run(run())
        finally:
            prof.disable()
            prof.dump_stats(profile)
    else:
        asyncio.run(run())
    conn.send("stopped")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (0.0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ============================================================ agent process


def _agent_main(conn: Connection, address: str, cpus: set[int] | None, batched: bool) -> None:
    _pin(cpus)
    asyncio.run(_agents(conn, address, batched))


CONFIRM_PERIOD_S = 0.01  # at most one barrier heartbeat per stream per period


def agent_hello(engine: str, role: Any, *, batched: bool) -> Any:
    """The hello of the benchmark's simulated agent rank of `engine` (TP 1)."""
    from pushkv.protocol import PROTOCOL_VERSION
    from pushkv.v1 import pushkv_pb2 as pb

    region = pb.KVRegion(base_addr=0x1000_0000, block_len=4096, num_blocks=4096)
    return pb.AgentHello(
        protocol_version=PROTOCOL_VERSION,
        identity=pb.AgentIdentity(
            engine_id=engine, role=role, tp_rank=0, tp_size=1, incarnation="b1"
        ),
        nixl_agent_name=f"{engine}-0",
        nixl_metadata=b"x" * 256,
        layout=pb.KVLayout(tokens_per_block=16, regions=[region]),
        accepts_batches=batched,
    )


async def _agents(conn: Connection, address: str, batched: bool) -> None:
    import grpc
    from pushkv.v1 import pushkv_pb2 as pb
    from pushkv.v1 import pushkv_pb2_grpc as pbg

    def hello(engine: str, role: Any) -> Any:
        return pb.AgentMessage(hello=agent_hello(engine, role, batched=batched))

    ordered: dict[str, float] = {}
    failed: dict[str, tuple[float, int]] = {}  # tid -> (when, state) from failure notices
    # A clean COMPLETE sends no notice. A transfer counts as completed when the
    # coordinator has processed both its DONE (prefill stream) and its arrival
    # (decode stream): it handles a stream's messages in order, so the ack of a
    # heartbeat sent after a report proves that report was applied.
    confirmed: dict[str, float] = {}
    half_done: dict[str, float] = {}  # one of the two final reports confirmed
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
                other = half_done.pop(tid, None)
                if other is None:
                    half_done[tid] = now
                else:
                    confirmed[tid] = now
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
    await sp.call.write(hello(PREFILL, pb.ROLE_PREFILL))
    await sd.call.write(hello(DECODE, pb.ROLE_DECODE))
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
            for m in items(msg):
                kind = m.WhichOneof("kind")
                if kind == "heartbeat_ack":
                    sp.acked(m.heartbeat_ack.seq)
                if kind != "order":
                    continue
                o = m.order
                ordered[o.transfer_id] = time.monotonic()
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
                    failed[m.notice.transfer_id] = (time.monotonic(), m.notice.state)

    async def heartbeats() -> None:
        while True:
            await asyncio.sleep(1.0)  # lease keep-alive period
            for s in (sp, sd):
                async with s.lock:  # seq 0 is never a barrier
                    await s.call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=0)))

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
            prefix: str = cmd[1]
            picked_o = {k: v for k, v in ordered.items() if k.startswith(prefix)}
            picked_f = {k: (t, 6) for k, t in confirmed.items() if k.startswith(prefix)}
            picked_f.update({k: v for k, v in failed.items() if k.startswith(prefix)})
            for k in picked_o:
                del ordered[k]
            for k in picked_f:
                confirmed.pop(k, None)
                failed.pop(k, None)
            conn.send((picked_o, picked_f))
        elif cmd[0] == "count":
            prefix = cmd[1]
            done = sum(1 for k in confirmed if k.startswith(prefix))
            conn.send(done + sum(1 for k in failed if k.startswith(prefix)))
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


# ============================================================ client process


def _client_main(
    conn: Connection, address: str, client_id: int, cpus: set[int] | None, batch: int
) -> None:
    _pin(cpus)
    asyncio.run(_client(conn, address, client_id, batch))


async def _client(conn: Connection, address: str, client_id: int, batch: int) -> None:
    import grpc
    from pushkv.v1 import pushkv_pb2 as pb
    from pushkv.v1 import pushkv_pb2_grpc as pbg

    channel: Any = grpc.aio.insecure_channel(address)
    stub: Any = pbg.TransferServiceStub(channel)
    rng = random.Random(client_id)
    d_blocks = [pb.BlockIds(ids=[7, 8, 9])]
    p_blocks = [pb.BlockIds(ids=[1, 2, 3])]

    def decode_req(tid: str) -> Any:
        return pb.RegisterDecodeBlocksRequest(
            transfer_id=tid, decode_engine_id=DECODE, block_ids=d_blocks, num_tokens=TOKENS
        )

    def prefill_req(tid: str) -> Any:
        return pb.ReportPrefillDoneRequest(
            transfer_id=tid, prefill_engine_id=PREFILL, block_ids=p_blocks, num_tokens=TOKENS
        )

    async def decode(tid: str) -> float:
        await stub.RegisterDecodeBlocks(decode_req(tid), timeout=RPC_TIMEOUT_S)
        return time.monotonic()

    async def prefill(tid: str) -> float:
        await stub.ReportPrefillDone(prefill_req(tid), timeout=RPC_TIMEOUT_S)
        return time.monotonic()

    returned: dict[str, float] = {}
    errors: dict[str, int] = {}
    first_detail: dict[str, str] = {}

    def error(code: str, detail: str) -> None:
        errors[code] = errors.get(code, 0) + 1
        first_detail.setdefault(code, detail)

    async def one(tid: str, both: bool) -> None:
        start = time.monotonic()
        try:
            if not both:
                returned[tid] = await decode(tid) - start
                return
            first, second = (decode, prefill) if rng.random() < 0.5 else (prefill, decode)
            t1 = asyncio.ensure_future(first(tid))
            t2 = asyncio.ensure_future(second(tid))
            returned[tid] = max(await asyncio.gather(t1, t2))
        except grpc.aio.AioRpcError as exc:
            error(exc.code().name, f"{exc.details()} {exc.debug_error_string()}")

    async def submit(calls: list[Any]) -> tuple[float, list[Any]]:
        resp = await stub.Submit(pb.SubmitRequest(calls=calls), timeout=RPC_TIMEOUT_S)
        return time.monotonic(), list(resp.results)

    async def many(tids: list[str]) -> None:
        """A decode engine's and a prefill engine's Submit for these transfers."""
        dec = [pb.TransferCall(register=decode_req(t)) for t in tids]
        pre = [pb.TransferCall(prefill_done=prefill_req(t)) for t in tids]
        first, second = (dec, pre) if rng.random() < 0.5 else (pre, dec)
        try:
            (t1, r1), (t2, r2) = await asyncio.gather(submit(first), submit(second))
        except grpc.aio.AioRpcError as exc:
            for _ in tids:
                error(exc.code().name, f"{exc.details()} {exc.debug_error_string()}")
            return
        when = max(t1, t2)
        for tid, a, b in zip(tids, r1, r2, strict=True):
            bad = a if a.code else b if b.code else None
            if bad is None:
                returned[tid] = when
            else:
                error(grpc.StatusCode(_STATUS[bad.code]).name, bad.message)

    _STATUS = {c.value[0]: c.value for c in grpc.StatusCode}

    while True:
        cmd = await asyncio.to_thread(conn.recv)
        if cmd[0] == "run":
            _, prefix, rate, duration, max_outstanding, step_s = cmd
            returned.clear()
            errors.clear()
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
                    if outstanding[0] + len(new) >= max_outstanding:
                        dropped += 1
                        continue
                    new.append(f"{prefix}-c{client_id}-{i}")
                    issued += 1
                # Unbatched: each transfer's two unary RPCs. Batched: what is
                # due now, in Submits of at most `batch` calls (never waiting).
                chunks = [new[i : i + batch] for i in range(0, len(new), batch)] if batch else []
                coros = [many(c) for c in chunks] if batch else [one(t, True) for t in new]
                sizes = [len(c) for c in chunks] if batch else [1] * len(new)
                for coro, size in zip(coros, sizes, strict=True):
                    task = asyncio.create_task(coro)
                    outstanding[0] += size
                    pending.add(task)

                    def finished(
                        t: asyncio.Task[None],
                        size: int = size,
                        pending: set[asyncio.Task[None]] = pending,
                        outstanding: list[int] = outstanding,
                    ) -> None:
                        pending.discard(t)
                        outstanding[0] -= size

                    task.add_done_callback(finished)
                next_at = t0 + (issued + dropped) / rate
                # Pacing of the open-loop offer (not synchronisation). Batched, a
                # client is an engine: it submits once per scheduler step.
                await asyncio.sleep(max(next_at - time.monotonic(), step_s, 0.0005))
            t_end = time.monotonic()
            if pending:
                await asyncio.wait(pending)
            for code, detail in first_detail.items():
                print(f"client {client_id}: {code}: {detail}", file=sys.stderr, flush=True)
            first_detail.clear()
            conn.send((t0, t_end, issued, dropped, dict(returned), dict(errors)))
        elif cmd[0] == "fill":
            _, prefix, count, concurrency = cmd
            returned.clear()
            errors.clear()
            sem = asyncio.Semaphore(concurrency)

            async def bounded(tid: str, sem: asyncio.Semaphore = sem) -> None:
                async with sem:
                    await one(tid, False)

            await asyncio.gather(*(bounded(f"{prefix}-{i}") for i in range(count)))
            conn.send((len(returned), dict(errors)))
        else:
            break
    await channel.close()


# ============================================================ controller


@dataclass
class Step:
    offered: float
    issued: int = 0
    dropped: int = 0
    completed: int = 0
    completed_per_s: float = 0.0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    order_ms: list[float] = field(default_factory=list)
    coord_cpu: float = 0.0
    drained: bool = True

    @property
    def saturated(self) -> bool:
        return (not self.drained) or self.completed_per_s < SATURATED * self.offered


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.coord_cpus, self.load_cpus = _cpu_split()
        self.procs: list[BaseProcess] = []

    def _spawn(self, target: Any, *args: Any) -> Connection:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        self.procs.append(p)
        return parent

    def start_coordinator(self, profile: str | None) -> tuple[Connection, int, int]:
        conn = self._spawn(_coordinator_main, self.coord_cpus, profile)
        if not conn.poll(30):
            raise RuntimeError("coordinator did not start")
        port: int = conn.recv()
        pid = self.procs[-1].pid
        assert pid is not None
        return conn, port, pid

    def start_agents(self, address: str, batched: bool = False) -> Connection:
        conn = self._spawn(_agent_main, address, self.load_cpus, batched)
        if not conn.poll(30) or conn.recv() != "ready":
            raise RuntimeError("agents did not start")
        return conn

    def stop_all(self) -> None:
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.procs.clear()

    # ------------------------------------------------------------ throughput
    def run_step(
        self,
        clients: list[Connection],
        agents: Connection,
        coord_pid: int,
        name: str,
        rate: float,
        duration: float,
        step_s: float = 0.0,
    ) -> Step:
        """One open-loop step."""
        step = Step(offered=rate)
        per_client = rate / len(clients)
        agents.send(("live",))
        live_before = int(agents.recv())  # held ones, or an overloaded step's leftovers
        cpu0 = _cpu_seconds(coord_pid)
        for c in clients:
            c.send(("run", name, per_client, duration, self.args.max_outstanding, step_s))
        results = [c.recv() for c in clients]  # every RPC of the step has returned
        cpu1, wall1 = _cpu_seconds(coord_pid), time.monotonic()
        t_start = min(r[0] for r in results)
        t_end = max(r[1] for r in results)
        returned: dict[str, float] = {}
        for _, _, issued, dropped, ret, errs in results:
            step.issued += issued
            step.dropped += dropped
            returned.update(ret)
            for k, v in errs.items():
                step.errors[k] = step.errors.get(k, 0) + v
        # Drain: wait (bounded) until the agents saw every admitted transfer end.
        want = len(returned)
        deadline = time.monotonic() + self.args.drain_s
        while True:
            agents.send(("count", name + "-"))
            done = int(agents.recv())
            if done >= want or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # polling another process's counter, with a deadline
        agents.send(("live",))
        live = int(agents.recv())
        step.drained = done >= want and live <= live_before
        agents.send(("collect", name + "-"))
        ordered, finished = agents.recv()
        step.coord_cpu = (cpu1 - cpu0) / max(wall1 - t_start, 1e-9)
        window = t_end - t_start
        in_window = [t for t, _ in finished.values() if t_start <= t <= t_end]
        step.completed = sum(1 for _, s in finished.values() if s == 6)  # COMPLETE
        step.failed = len(finished) - step.completed
        step.completed_per_s = len(in_window) / window if window > 0 else 0.0
        step.order_ms = [
            (ordered[tid] - returned[tid]) * 1000 for tid in returned if tid in ordered
        ]
        return step

    def throughput(self, batch: int, profile: str | None) -> tuple[list[Step], Step | None]:
        """Saturation and half-load latency; `batch` > 0: Submit batches of at
        most that many calls, and batching agents."""
        a = self.args
        conn, port, pid = self.start_coordinator(profile)
        address = f"127.0.0.1:{port}"
        mode = f"batched (Submit <= {batch} calls, agent batches)" if batch else "unbatched"
        print(f"{mode}: coordinator pid {pid} on {address} (attach py-spy here)", flush=True)
        agents = self.start_agents(address, batched=batch > 0)
        clients = [
            self._spawn(_client_main, address, i, self.load_cpus, batch) for i in range(a.clients)
        ]
        steps: list[Step] = []
        half: Step | None = None
        start_rate = a.start_rate * (a.batch_start_factor if batch else 1)
        try:
            step_s = a.step_ms / 1000 if batch else 0.0
            self.run_step(clients, agents, pid, "warm", start_rate / 2, 1.0, step_s=step_s)
            rate = start_rate
            for i in range(a.max_steps):
                s = self.run_step(clients, agents, pid, f"s{i}", rate, a.duration, step_s=step_s)
                steps.append(s)
                _print_row(s)
                if s.saturated or rate >= a.max_rate:
                    break
                rate *= a.factor
            if len(steps) > 1 and steps[-1].saturated:
                # Between the last rate kept up with and the first that was not.
                low = steps[-2].offered
                for j in range(1, a.refine + 1):
                    r = low * a.factor ** (j / (a.refine + 1))
                    s = self.run_step(clients, agents, pid, f"r{j}", r, a.duration, step_s=step_s)
                    steps.append(s)
                    _print_row(s, "refine")
                    if s.saturated:
                        break
            sat = max(s.completed_per_s for s in steps)
            half = self.run_step(clients, agents, pid, "half", sat / 2, a.duration, step_s=step_s)
            half.offered = sat / 2
            _print_row(half, "half-sat")
        finally:
            for c in clients:
                c.send(("quit",))
            agents.send(("quit",))
            conn.send("stop")
            with contextlib.suppress(EOFError):
                if conn.poll(30):
                    conn.recv()
            self.stop_all()
        return steps, half

    # ------------------------------------------------------------ memory
    def memory(self) -> tuple[int, int, int, Step | None]:
        a = self.args
        conn, port, pid = self.start_coordinator(None)
        address = f"127.0.0.1:{port}"
        agents = self.start_agents(address)
        loaded: Step | None = None
        client = self._spawn(_client_main, address, 99, self.load_cpus, 0)
        try:
            client.send(("fill", "warm", min(1000, a.inflight), 200))
            client.recv()
            before = _rss_bytes(pid)
            client.send(("fill", "held", a.inflight, 200))
            ok, errors = client.recv()
            after = _rss_bytes(pid)
            if errors or ok != a.inflight:
                print(f"memory phase: {ok} registered, errors {errors}", file=sys.stderr)
            # Load while those transfers stay held: latency must stay steady and
            # every admitted rendezvous must complete.
            loaded = self.run_step([client], agents, pid, "loaded", a.loaded_rate, a.duration)
        finally:
            client.send(("quit",))
            agents.send(("quit",))
            conn.send("stop")
            with contextlib.suppress(EOFError):
                if conn.poll(30):
                    conn.recv()
            self.stop_all()
        return before, after, ok, loaded


def core_build() -> str:
    """Which build of the core the spawned coordinator imports (same environment)."""
    from controlplane.core_build import core_build as build

    return "core: compiled (mypyc)" if build() == "compiled" else "core: pure Python"


def _print_row(s: Step, label: str = "") -> None:
    errs = ",".join(f"{k}:{v}" for k, v in sorted(s.errors.items())) or "-"
    print(
        f"{label or 'step':>9} {s.offered:>9.0f} {s.issued:>7} {s.completed_per_s:>12.0f} "
        f"{_pct(s.order_ms, 0.5):>9.2f} {_pct(s.order_ms, 0.99):>9.2f} "
        f"{s.coord_cpu * 100:>6.0f}% {s.dropped:>7} {s.failed:>6} "
        f"{'yes' if s.drained else 'NO':>7}  {errs}",
        flush=True,
    )


def _print_profile(path: str, top: int) -> None:
    out = io.StringIO()
    stats = pstats.Stats(path, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    print("\ncoordinator profile (cProfile, by own time):")
    print("\n".join(out.getvalue().splitlines()[: top + 12]))
    out = io.StringIO()
    stats = pstats.Stats(path, stream=out)
    stats.strip_dirs().sort_stats("cumulative").print_stats(top)
    print("\ncoordinator profile (cProfile, cumulative):")
    print("\n".join(out.getvalue().splitlines()[: top + 12]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pushkv bench coordinator",
        description="rendezvous throughput, order latency and memory per transfer",
    )
    p.add_argument("--quick", action="store_true", help="short steps (< 90 s in all)")
    p.add_argument("--clients", type=int, default=2, help="request-client processes")
    p.add_argument("--start-rate", type=float, default=300.0, help="first offered rate (/s)")
    p.add_argument("--factor", type=float, default=1.5, help="rate growth per step")
    p.add_argument("--max-rate", type=float, default=50_000.0)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument(
        "--refine",
        type=int,
        default=2,
        help="extra steps between the last rate sustained and the first saturated one",
    )
    p.add_argument("--duration", type=float, default=8.0, help="seconds per step")
    p.add_argument("--drain-s", type=float, default=15.0, help="max wait for a backlog")
    p.add_argument("--max-outstanding", type=int, default=4000, help="per client")
    p.add_argument("--inflight", type=int, default=10_000, help="transfers held for RSS")
    p.add_argument(
        "--loaded-rate",
        type=float,
        default=200.0,
        help="rendezvous/s offered while --inflight transfers are held",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=256,
        help="calls per Submit in the batched run, as the connector's client sends "
        "(0: unbatched run only)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=10.0,
        help="batched run: each client submits once per this period (an engine step)",
    )
    p.add_argument(
        "--batch-start-factor",
        type=float,
        default=5.0,
        help="the batched run starts at this many times --start-rate",
    )
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="cProfile the coordinator into FILE (FILE.batched for the batched run)",
    )
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--batched-only", action="store_true", help="skip the unbatched run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 3.0)
        args.drain_s = min(args.drain_s, 6.0)
        args.inflight = min(args.inflight, 10_000)
        args.max_steps = min(args.max_steps, 8)
    bench = Bench(args)
    print(core_build())
    print(
        f"coordinator CPUs {sorted(bench.coord_cpus or []) or 'any'}, "
        f"load CPUs {sorted(bench.load_cpus or []) or 'any'}, {args.clients} clients, "
        f"{args.duration:g} s per step"
    )
    print(
        f"{'':>9} {'offered/s':>9} {'issued':>7} {'completed/s':>12} {'order_p50':>9} "
        f"{'order_p99':>9} {'coordCPU':>7} {'dropped':>7} {'failed':>6} {'drained':>7}  errors"
    )
    t0 = time.monotonic()
    runs: list[tuple[str, list[Step], Step | None]] = []
    try:
        if not args.batched_only:
            steps, half = bench.throughput(0, args.profile)
            runs.append(("unbatched", steps, half))
        if args.batch > 0:
            prof = args.profile and args.profile + ".batched"
            steps, half = bench.throughput(args.batch, prof)
            runs.append(("batched", steps, half))
        before, after, held, loaded = bench.memory()
    finally:
        bench.stop_all()
    per = (after - before) / held if held else float("nan")
    figures: dict[str, tuple[float, float, float]] = {}
    print()
    for name, steps, half in runs:
        sat = max(steps, key=lambda s: s.completed_per_s)
        p50 = _pct(half.order_ms, 0.5) if half else float("nan")
        p99 = _pct(half.order_ms, 0.99) if half else float("nan")
        figures[name] = (sat.completed_per_s, p50, p99)
        print(
            f"{name} saturation: {sat.completed_per_s:.0f} rendezvous/s "
            f"(offered {sat.offered:.0f}/s, coordinator CPU {sat.coord_cpu * 100:.0f}%)"
        )
        if half is not None:
            print(
                f"{name} order latency at {half.offered:.0f}/s: p50 {p50:.2f} ms, "
                f"p99 {p99:.2f} ms ({len(half.order_ms)} orders)"
            )
    if "batched" in figures and "unbatched" in figures:
        print(f"batched / unbatched: {figures['batched'][0] / figures['unbatched'][0]:.1f}x")
    print(
        f"memory: VmRSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB for {held} "
        f"REGISTERED transfers = {per:.0f} bytes each"
    )
    if loaded is not None:
        print(
            f"with {held} transfers held: {loaded.offered:.0f}/s offered, "
            f"{loaded.completed} completed, {loaded.failed} failed, drained={loaded.drained}, "
            f"order p50 {_pct(loaded.order_ms, 0.5):.2f} ms, "
            f"p99 {_pct(loaded.order_ms, 0.99):.2f} ms"
        )
    print(f"elapsed {time.monotonic() - t0:.0f} s")
    if args.profile:
        if not args.batched_only:
            _print_profile(args.profile, args.profile_top)
        if args.batch > 0:
            print("\n(batched run)")
            _print_profile(args.profile + ".batched", args.profile_top)
    line = f"bytes_per_inflight={per:.0f}"
    if "unbatched" in figures:
        rps, p50, p99 = figures["unbatched"]
        line = f"rendezvous_per_s={rps:.0f} order_p50_ms={p50:.2f} order_p99_ms={p99:.2f} " + line
    if "batched" in figures:
        rps, p50, p99 = figures["batched"]
        line += (
            f" rendezvous_per_s_batched={rps:.0f} order_p50_ms_batched={p50:.2f}"
            f" order_p99_ms_batched={p99:.2f}"
        )
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
