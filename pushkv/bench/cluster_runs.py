"""The controller of `pushkv bench cluster`: a real etcd, real coordinator
replicas (``pushkv coordinator --etcd``), host processes of simulated agent
ranks (`pushkv.bench.cluster_agents`), and the phases: registration, heartbeat load,
the rate ramp, half load, and a ``kill -9`` of the leader.

Nothing gRPC-async lives here; the controller polls the replicas
(GetLeadership, ListTransfers) and asks the hosts over pipes. Every wait is a
poll under a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import grpc

from pushkv.bench.cluster_agents import HostSpec, Stats, engines, host_main
from pushkv.bench.coordinator_load import ClientReport
from pushkv.bench.coordinator_server import cpu_seconds, cpu_split, rss_bytes, tcp_connections
from pushkv.bench.coordinator_step import Step, measure_step
from pushkv.bench.coordinator_workload import CORE_SETTINGS
from pushkv.bench.leader_metrics import Buckets, leader_share, scrape
from pushkv.harness.coordinator import CoordinatorProcess, leadership
from pushkv.harness.etcd import EtcdCluster, EtcdServer
from pushkv.harness.vllm_server import free_port
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

POLL_S = 0.005  # leadership polls after the kill (as pushkv/bench/failover.py)
WAIT_S = 0.05  # other polls of another process's state
LIVE = [
    pb.TRANSFER_STATE_AWAITING,
    pb.TRANSFER_STATE_REGISTERED,
    pb.TRANSFER_STATE_PREFILL_DONE,
    pb.TRANSFER_STATE_ORDERED,
    pb.TRANSFER_STATE_WRITING,
]


@dataclass
class Idle:
    """Heartbeat load: the cluster registered and idle."""

    seconds: float = 0.0
    received_per_s: float = 0.0  # agent messages the leader acknowledged or answered
    acks_per_s: float = 0.0
    leader_cpu: float = 0.0  # fraction of one core
    host_cpu: float = 0.0  # all hosts together, fraction of one core
    rss_mib: float = 0.0


@dataclass
class Failover:
    failover_s: float = float("nan")  # kill -> a standby leads
    followed_s: float = float("nan")  # kill -> every rank re-registered with it
    followed: int = 0  # ranks registered with the new leader at the end
    follow_p50_s: float = float("nan")
    hellos: int = 0  # streams the ranks opened between the kill and the end
    refused: int = 0  # ... of which ended in an error (refused by a standby or dead)
    old: str = ""
    new: str = ""
    how: str = "kill"  # or "freeze" (--failure)
    silenced: int = 0  # freeze: streams the ranks left for the old leader's silence
    redirected: int = 0  # freeze: and for the new leader a replica named meanwhile
    old_exit: int | None = None  # freeze: the old leader's exit status once thawed


@dataclass
class Result:
    agents: int = 0
    registered_s: float = float("nan")  # start -> every rank welcomed by the leader
    idle: Idle = field(default_factory=Idle)
    steps: list[Step] = field(default_factory=list)
    saturated: bool = False
    half: Step | None = None
    loaded_rss_mib: float = 0.0
    failover: Failover = field(default_factory=Failover)
    after: Step | None = None  # a step against the new leader
    host_cpu: list[float] = field(default_factory=list)  # per step, all hosts, of one core
    leader_cpus: int = 1  # the CPUs the leader was pinned to (0: not pinned)
    # Registered and idle: the TCP connections on the leader's port.
    connections: int = 0
    msgs: list[tuple[float, float]] = field(default_factory=list)  # per step: to, from leader
    relay: bool = False  # --relay: each engine's ranks through one NodeStream
    node_streams: int = 0  # NodeStreams the hosts' Upstreams opened, the whole run
    up_messages: int = 0  # NodeUp messages they sent, the whole run
    relayed_submits: int = 0  # Submits they carried, the whole run
    agent_writes: int = 0  # stream messages the ranks wrote (hellos, reports), the whole run

    @property
    def saturation(self) -> Step:
        return max(self.steps, key=lambda s: s.completed_per_s)


def poll(cond: Callable[[], bool], what: str, deadline_s: float, every_s: float = WAIT_S) -> float:
    """Poll `cond` until it holds; the seconds it took. TimeoutError past the deadline."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > deadline_s:
            raise TimeoutError(f"not within {deadline_s:g} s: {what}")
        time.sleep(every_s)  # polling other processes, under a deadline
    return time.monotonic() - start


def pin_all_threads(pid: int, cpus: set[int] | None) -> None:
    """Pin every thread of process `pid` (gRPC starts its own) to `cpus`."""
    if not cpus:
        return
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)


def core_flags() -> list[str]:
    """`pushkv coordinator` flags for the benchmarks' rendezvous settings."""
    out: list[str] = []
    for k, v in CORE_SETTINGS.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out


class ClusterBench:
    def __init__(self, args: argparse.Namespace, row: Callable[[Step, str], None]) -> None:
        self.a = args
        self.row = row
        self.ctx = mp.get_context("spawn")
        self.coord_cpus, self.load_cpus = cpu_split(getattr(args, "leader_cpus", None) or 1)
        self.etcd: EtcdServer | EtcdCluster | None = None
        self.replicas: list[CoordinatorProcess] = []
        self.metrics_ports: dict[int, int] = {}  # id(replica) -> its /metrics port
        self.procs: list[BaseProcess] = []
        self.hosts: list[Connection] = []
        self.leader: CoordinatorProcess | None = None
        self.last_host_cpu = 0.0  # the last step's, all hosts, fraction of one core
        self.last_msgs = (0.0, 0.0)  # the last step's agent messages/s (to, from) the leader

    # ------------------------------------------------------------ processes
    def start(self) -> None:
        a = self.a
        if a.etcd_members > 1:
            cluster = self.etcd = EtcdCluster(a.etcd_members).start()
            members, url = cluster.members, cluster.urls
        else:
            single = self.etcd = EtcdServer("pushkv-bench").start()
            members, url = [single], single.url
        for m in members:
            pin_all_threads(m.proc.pid if m.proc else 0, self.load_cpus)
        flags = ["--etcd", url, "--etcd-lease-s", str(a.lease_s)]
        flags += ["--log-level", "WARNING", *core_flags()]
        for _ in range(a.replicas):
            port = free_port() if a.leader_metrics else 0
            more = ["--metrics-port", str(port)] if port else []
            r = CoordinatorProcess(*flags, *more).start()
            self.replicas.append(r)
            if port:
                self.metrics_ports[id(r)] = port
        self.leader = self.find_leader(self.replicas)
        self.place()

    def place(self) -> None:
        """The leader's processes on its CPUs (--leader-cpus), everything else
        on the others."""
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                cpus = self.coord_cpus if r is self.leader else self.load_cpus
                pin_all_threads(r.proc.pid, cpus)

    def find_leader(self, among: list[CoordinatorProcess]) -> CoordinatorProcess:
        found: list[CoordinatorProcess] = []

        def leads() -> bool:
            for r in among:
                v = leadership(r.address, timeout=1)
                if v is not None and v.role == pb.LEADER_ROLE_LEADER:
                    found.append(r)
                    return True
            return False

        poll(leads, "a replica leads", self.a.deadline_s, POLL_S)
        return found[0]

    def start_hosts(self) -> float:
        """Spawn the hosts; the seconds until every rank was welcomed by the leader."""
        a = self.a
        assert self.leader is not None
        addresses = ",".join(r.address for r in self.replicas)
        t0 = time.monotonic()
        for h, (pre, dec) in enumerate(engines(a.engines, a.hosts)):
            spec = HostSpec(
                h,
                tuple(pre),
                tuple(dec),
                a.tp,
                addresses,
                a.start_spread_s,
                h + 1,
                a.relay,
                relay_submit=a.relay and not a.submit_direct,
            )
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(target=host_main, args=(child, spec, self.load_cpus), daemon=True)
            p.start()
            self.procs.append(p)
            self.hosts.append(parent)
        for c in self.hosts:
            if not c.poll(self.a.deadline_s) or c.recv() != "started":
                raise RuntimeError("a host process did not start")
        want: int = a.engines * a.tp
        lead = self.leader.address
        poll(lambda: self.registered(lead) >= want, f"{want} ranks registered", a.deadline_s)
        return time.monotonic() - t0

    def ask(self, *cmd: Any) -> list[Any]:
        for c in self.hosts:
            c.send(cmd)
        return [c.recv() for c in self.hosts]

    def stats(self) -> list[tuple[int, Stats, dict[str, int]]]:
        return self.ask("stats")

    def registered(self, address: str) -> int:
        return sum(regs.get(address, 0) for _, _, regs in self.stats())

    def leader_metrics(self) -> dict[str, Buckets] | None:
        """The leader's histograms now (None without --leader-metrics)."""
        port = self.metrics_ports.get(id(self.leader))
        return scrape(port) if port else None

    def host_cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs if p.pid is not None)

    def stop(self) -> None:
        for c in self.hosts:
            with contextlib.suppress(OSError, ValueError):
                c.send(("quit",))
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for r in self.replicas:
            r.stop()
        if self.etcd is not None:
            self.etcd.stop()

    # ------------------------------------------------------------ phases
    def idle(self) -> Idle:
        """Heartbeat load over --idle-s seconds of a registered, idle cluster."""
        assert self.leader is not None and self.leader.proc is not None
        pid = self.leader.proc.pid
        s0, c0, h0, t0 = self.stats(), cpu_seconds(pid), self.host_cpu(), time.monotonic()
        time.sleep(self.a.idle_s)  # the measured interval itself
        s1, c1, h1, t1 = self.stats(), cpu_seconds(pid), self.host_cpu(), time.monotonic()
        dt = t1 - t0
        sent = sum(b[1].sent for b in s1) - sum(b[1].sent for b in s0)
        acks = sum(b[1].acks for b in s1) - sum(b[1].acks for b in s0)
        return Idle(
            dt, sent / dt, acks / dt, (c1 - c0) / dt, (h1 - h0) / dt, rss_bytes(pid) / 2**20
        )

    def live(self) -> int:
        lead = self.leader
        assert lead is not None and lead.proc is not None
        with grpc.insecure_channel(lead.address) as ch:
            try:
                r = pbg.StatusServiceStub(ch).ListTransfers(
                    pb.ListTransfersRequest(states=LIVE, limit=1), timeout=10
                )
            except grpc.RpcError:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    lead.proc.wait(10)  # a leader stepping down cancels calls, then exits
                if lead.proc.poll() is None:
                    raise
                # Exit 3: it did not renew its etcd lease in time (a saturated
                # event loop, or etcd starved of CPU) and stepped down.
                raise RuntimeError(
                    f"the leader exited ({lead.proc.returncode}) under load; its log: "
                    f"{lead.log_text()[-600:]}"
                ) from None
            return int(r.total_matching)

    def step(self, name: str, rate: float, duration: float, label: str = "") -> Step:
        """One open-loop step at `rate` transfers/s (all hosts), then its drain."""
        a = self.a
        assert self.leader is not None and self.leader.proc is not None
        pid = self.leader.proc.pid
        m0 = self.leader_metrics()
        cpu0, h0, st0 = cpu_seconds(pid), self.host_cpu(), self.stats()
        share = rate / len(self.hosts)
        cap = a.max_outstanding
        reports: list[ClientReport] = self.ask("run", name, share, duration, cap, a.step_ms / 1000)
        cpu1, h1 = cpu_seconds(pid), self.host_cpu()
        wall1, st1 = time.monotonic(), self.stats()
        m1 = self.leader_metrics()  # as the offer ends: its lag samples are the load's
        want = sum(len(r.sent) for r in reports)
        drained = True
        try:  # every admitted transfer ordered on every rank (or failed), nothing live
            poll(
                lambda: sum(self.ask("count", name + "-")) >= want and self.live() == 0,
                "the step drained",
                a.drain_s,
            )
        except TimeoutError:
            drained = False
        ordered: dict[str, float] = {}
        ends: dict[str, tuple[float, int]] = {}
        checked = wrong = 0
        for o, e, (c, w) in self.ask("collect", name + "-"):
            ordered.update(o)
            ends.update(e)
            checked, wrong = checked + c, wrong + w
        s = measure_step(rate, reports, ordered, ends)
        s.drained = drained
        if m0 is not None and m1 is not None:
            s.leader = leader_share(m0, m1)
        s.checked, s.check_failed = checked, wrong
        t_start = min(r.t0 for r in reports)
        s.coord_cpu = (cpu1 - cpu0) / max(wall1 - t_start, 1e-9)
        self.row(s, label)
        dt = max(wall1 - t_start, 1e-9)
        self.last_host_cpu = (h1 - h0) / dt
        self.last_msgs = (
            (sum(x[1].sent for x in st1) - sum(x[1].sent for x in st0)) / dt,
            (sum(x[1].received for x in st1) - sum(x[1].received for x in st0)) / dt,
        )
        return s

    def ramp(self, res: Result) -> None:
        """Rates rising by --factor until a step (and its recheck) saturates."""
        a = self.a
        self.step("warm", a.start_rate / 2, 1.0, "warm")
        rate = a.start_rate
        for i in range(a.max_steps):
            s = self.step(f"s{i}", rate, a.duration)
            res.steps.append(s)
            res.host_cpu.append(self.last_host_cpu)
            res.msgs.append(self.last_msgs)
            if s.saturated and a.recheck:  # on a shared host one hiccup is not saturation
                s = self.step(f"s{i}x", rate, a.duration, "again")
                res.steps.append(s)
                res.host_cpu.append(self.last_host_cpu)
                res.msgs.append(self.last_msgs)
            res.saturated = s.saturated
            if s.saturated or rate >= a.max_rate:
                break
            rate *= a.factor
        res.half = self.step("half", res.saturation.completed_per_s / 2, a.duration, "half-sat")

    def failover(self) -> Failover:
        """kill -9 (or freeze, --failure) the leader; time until a standby leads
        and until every rank registered with it. A frozen leader is thawed
        after, and its exit status kept (3: it found its leadership lost)."""
        a = self.a
        old = self.leader
        assert old is not None
        others = [r for r in self.replicas if r is not old]
        want: int = a.engines * a.tp

        def agreed() -> bool:  # every standby names the leader: it holds its lease
            views = [leadership(r.address, timeout=1) for r in others]
            return all(v is not None and v.leader == old.address for v in views)

        poll(agreed, "the standbys name the leader", a.deadline_s)
        before = self.stats()
        t_kill = time.monotonic()
        frozen = a.failure == "freeze"
        old.freeze() if frozen else old.kill()
        self.replicas.remove(old)  # no longer stopped with the others: below
        try:
            new = self.find_leader(others)
            fo = Failover(failover_s=time.monotonic() - t_kill, old=old.address, new=new.address)
            fo.how = a.failure
            self.leader = new
            self.place()
            times: list[float] = []

            def all_followed() -> bool:
                times[:] = [t for part in self.ask("followed", new.address, t_kill) for t in part]
                return len(times) >= want

            with contextlib.suppress(TimeoutError):
                poll(all_followed, f"{want} ranks registered with {new.address}", a.deadline_s)
        finally:
            if frozen:
                old.thaw()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    assert old.proc is not None
                    old.proc.wait(a.deadline_s)  # it finds its lease gone and exits
            old.stop()
        if frozen and old.proc is not None:
            fo.old_exit = old.proc.returncode
        after = self.stats()
        fo.followed = len(times)
        if times:
            rel = sorted(t - t_kill for t in times)
            fo.follow_p50_s = rel[len(rel) // 2]
            if len(times) >= want:
                fo.followed_s = rel[-1]
        fo.hellos = sum(s.hellos for _, s, _ in after) - sum(s.hellos for _, s, _ in before)
        fo.refused = sum(s.refused for _, s, _ in after) - sum(s.refused for _, s, _ in before)
        fo.silenced = sum(s.silenced for _, s, _ in after) - sum(s.silenced for _, s, _ in before)
        fo.redirected = sum(s.redirected for _, s, _ in after) - sum(
            s.redirected for _, s, _ in before
        )
        return fo

    def run(self) -> Result:
        a = self.a
        res = Result(agents=a.engines * a.tp, relay=a.relay)
        res.leader_cpus = len(self.coord_cpus) if self.coord_cpus else 0
        self.start()
        res.registered_s = self.start_hosts()
        res.idle = self.idle()
        lead = self.leader
        assert lead is not None and lead.proc is not None
        res.connections = tcp_connections(lead.proc.pid, lead.port)
        if a.max_steps > 0:
            self.ramp(res)
        assert self.leader is not None and self.leader.proc is not None
        res.loaded_rss_mib = rss_bytes(self.leader.proc.pid) / 2**20
        res.failover = self.failover()
        if a.max_steps > 0 and res.failover.followed >= res.agents:
            rate = res.half.offered if res.half is not None else a.start_rate
            res.after = self.step("after", rate, min(a.duration, 2.0), "new-lead")
        counts = [s for _, s, _ in self.stats()]
        res.node_streams = sum(s.node_streams for s in counts)
        res.up_messages = sum(s.up_messages for s in counts)
        res.relayed_submits = sum(s.relayed_submits for s in counts)
        res.agent_writes = sum(s.writes for s in counts)
        return res
