"""The controller of `pushkv bench coordinator`: it spawns the processes
(multiprocessing "spawn"; nothing gRPC lives in the controller), runs the
open-loop steps, the rate ramp to saturation, and the memory phase.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from pushkv.bench.coordinator_agents import agents_main
from pushkv.bench.coordinator_load import ClientReport, client_main
from pushkv.bench.coordinator_server import (
    CoordinatorReady,
    coordinator_main,
    cpu_seconds,
    cpu_split,
    rss_bytes,
)
from pushkv.bench.coordinator_step import Step, measure_step


@dataclass
class Run:
    """One mode's ramp on a fresh coordinator."""

    mode: str  # "batched" or "unbatched"
    batch: int  # most calls per Submit (0: unbatched)
    steps: list[Step] = field(default_factory=list)
    half: Step | None = None  # at half the saturation rate: the latency figures
    core: str = ""  # the `core:` line its coordinator process reported
    # False: the ramp ended (--max-steps, --max-rate) before a step and its
    # rechecks saturated, so the saturation figure is a lower bound.
    saturated: bool = False

    @property
    def saturation(self) -> Step:
        return max(self.steps, key=lambda s: s.completed_per_s)


@dataclass
class Memory:
    before: int  # VmRSS, bytes
    after: int
    held: int  # transfers REGISTERED between the two readings
    loaded: Step | None  # a step run while they stay held
    core: str = ""

    @property
    def per_transfer(self) -> float:
        return (self.after - self.before) / self.held if self.held else float("nan")


class Bench:
    def __init__(self, args: argparse.Namespace, row: Callable[[Step, str], None]) -> None:
        self.args = args
        self.row = row  # prints a step's table row
        self.ctx = mp.get_context("spawn")
        self.coord_cpus, self.load_cpus = cpu_split()
        self.procs: list[BaseProcess] = []

    def _spawn(self, target: Any, *args: Any) -> Connection:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        self.procs.append(p)
        return parent

    def start_coordinator(self, profile: str | None) -> tuple[Connection, CoordinatorReady, int]:
        conn = self._spawn(coordinator_main, self.coord_cpus, profile)
        if not conn.poll(30):
            raise RuntimeError("coordinator did not start")
        ready: CoordinatorReady = conn.recv()
        pid = self.procs[-1].pid
        assert pid is not None
        return conn, ready, pid

    def start_agents(self, address: str, batched: bool = False) -> Connection:
        conn = self._spawn(agents_main, address, self.load_cpus, batched)
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

    def _shut(self, coord: Connection, others: list[Connection]) -> None:
        for c in others:
            c.send(("quit",))
        coord.send("stop")
        with contextlib.suppress(EOFError):
            if coord.poll(30):
                coord.recv()
        self.stop_all()

    # ------------------------------------------------------------ one step
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
        """One open-loop step at `rate` transfers/s, then its drain."""
        agents.send(("live",))
        live_before = int(agents.recv())  # held ones, or an overloaded step's leftovers
        cpu0 = cpu_seconds(coord_pid)
        for c in clients:
            c.send(("run", name, rate / len(clients), duration, self.args.max_outstanding, step_s))
        reports: list[ClientReport] = [c.recv() for c in clients]  # every RPC has returned
        cpu1, wall1 = cpu_seconds(coord_pid), time.monotonic()
        # Drain: wait (bounded) until the agents saw every admitted transfer end.
        want = sum(len(r.sent) for r in reports)
        deadline = time.monotonic() + self.args.drain_s
        while True:
            agents.send(("count", name + "-"))
            done = int(agents.recv())
            if done >= want or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # polling another process's counter, with a deadline
        agents.send(("live",))
        live = int(agents.recv())
        agents.send(("collect", name + "-"))
        ordered, ends, (checked, check_failed) = agents.recv()
        step = measure_step(rate, reports, ordered, ends)
        step.drained = done >= want and live <= live_before
        step.checked, step.check_failed = checked, check_failed
        t_start = min(r.t0 for r in reports)
        step.coord_cpu = (cpu1 - cpu0) / max(wall1 - t_start, 1e-9)
        return step

    # ------------------------------------------------------------ throughput
    def throughput(self, batch: int, profile: str | None) -> Run:
        """Ramp to saturation, then half-load latency; `batch` > 0: Submit
        groups of at most that many calls, and batching agents."""
        a = self.args
        run = Run("batched" if batch else "unbatched", batch)
        conn, ready, pid = self.start_coordinator(profile)
        run.core = ready.core
        address = f"127.0.0.1:{ready.port}"
        mode = f"batched (Submit <= {batch} calls, agent batches)" if batch else "unbatched"
        print(f"{mode}: coordinator pid {pid} on {address} (attach py-spy here)", flush=True)
        print(f"  {ready.core}, in the coordinator process ({ready.core_path})", flush=True)
        agents = self.start_agents(address, batched=batch > 0)
        clients = [
            self._spawn(client_main, address, i, self.load_cpus, batch) for i in range(a.clients)
        ]
        start_rate = a.start_rate * (a.batch_start_factor if batch else 1)
        step_s = a.step_ms / 1000 if batch else 0.0

        def step(name: str, rate: float, label: str = "") -> Step:
            s = self.run_step(clients, agents, pid, name, rate, a.duration, step_s=step_s)
            self.row(s, label)
            return s

        try:
            self.run_step(clients, agents, pid, "warm", start_rate / 2, 1.0, step_s=step_s)
            rate = start_rate
            sustained: float | None = None  # the last rate kept up with
            for i in range(a.max_steps):
                s = step(f"s{i}", rate)
                run.steps.append(s)
                for k in range(a.recheck if s.saturated else 0):
                    # A saturated step runs again before the ramp stops: on a
                    # shared host one hiccup is not saturation.
                    s = step(f"s{i}x{k}", rate, "again")
                    run.steps.append(s)
                    if not s.saturated:
                        break
                run.saturated = s.saturated
                if s.saturated or rate >= a.max_rate:
                    break
                sustained = rate
                rate *= a.factor
            if sustained is not None and run.steps[-1].saturated:
                # Between the last rate kept up with and the first that was not.
                low = sustained
                for j in range(1, a.refine + 1):
                    s = step(f"r{j}", low * a.factor ** (j / (a.refine + 1)), "refine")
                    run.steps.append(s)
                    if s.saturated:
                        break
            run.half = step("half", run.saturation.completed_per_s / 2, "half-sat")
        finally:
            self._shut(conn, [*clients, agents])
        return run

    # ------------------------------------------------------------ memory
    def memory(self) -> Memory:
        """VmRSS growth over --inflight REGISTERED transfers, then a step under them."""
        a = self.args
        conn, ready, pid = self.start_coordinator(None)
        address = f"127.0.0.1:{ready.port}"
        agents = self.start_agents(address)
        client = self._spawn(client_main, address, 99, self.load_cpus, 0)
        try:
            client.send(("fill", "warm", min(1000, a.inflight), 200))
            client.recv()
            before = rss_bytes(pid)
            client.send(("fill", "held", a.inflight, 200))
            ok, errors = client.recv()
            after = rss_bytes(pid)
            if errors or ok != a.inflight:
                print(f"memory phase: {ok} registered, errors {errors}", file=sys.stderr)
            # Load while those transfers stay held: latency must stay steady and
            # every admitted rendezvous must complete.
            loaded = self.run_step([client], agents, pid, "loaded", a.loaded_rate, a.duration)
        finally:
            self._shut(conn, [client, agents])
        return Memory(before, after, ok, loaded, ready.core)
