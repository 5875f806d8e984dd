"""``pushkv bench cluster``: a simulated cluster of agent ranks (default 125
engines x 8 ranks = 1,000 agents) against real coordinator replicas on a real
etcd: heartbeat load, rendezvous/s, order latency at half load, the leader's
memory, and a ``kill -9`` of the leader (failover, and every agent following
the new leader).

Processes: one etcd (``pushkv/harness/etcd.py``; ``--etcd-members 3``: a
three-member cluster on loopback, every replica given all three), ``--replicas`` coordinators
(``pushkv coordinator --etcd``, ``pushkv/harness/coordinator.py``), ``--hosts`` host
processes of simulated ranks (`pushkv.bench.cluster_agents`: one gRPC channel and
AgentStream per rank, asyncio, following the leader as ``agent/link.py``
does; ``--relay``: one node relay's NodeStream per engine, its ranks as
channels, ``pushkv/relay/upstream.py`` following the leader). The leader is
pinned to the first ``--leader-cpus`` CPUs (default one) when the host has
more; etcd, the standby and the hosts share the others. On a small
box the hosts may be what saturates first: the table prints their CPU, and the
figures are "simulated agents, same host".

Counting (`pushkv.bench.coordinator_step`'s rules; what differs): a transfer counts
when the simulated prefill agents received its order on every rank during the
offer (its rendezvous done and ordered), no notice failed it, and the step
drained (every transfer ordered on every rank, and the leader lists none
live: the DONE and arrival reports of all of them were applied). A sample is
asked back from the leader (GetTransfer: COMPLETE). Order latency: the send of
the call that completed the rendezvous -> the last of its TP orders received.
The final line:

    agents=<n> rendezvous_per_s=<r> order_p99_ms=<p> failover_s=<f> agents_followed_s=<g>
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence

from pushkv.bench.cluster_runs import ClusterBench, Result
from pushkv.bench.coordinator_report import header, row
from pushkv.bench.coordinator_server import cpu_split
from pushkv.bench.output import say
from pushkv.bench.stats import percentile
from pushkv.net.event_loop import LAG_TICK_S

GOALS = "goals (issue 20): >= 20000 rendezvous/s, order p99 <= 2 ms at half load, "
GOALS += "every agent following a new leader within 5 s"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pushkv bench cluster",
        description="a simulated cluster of agents against replicated coordinators on etcd",
    )
    p.add_argument("--quick", action="store_true", help="short steps (about 1-2 minutes)")
    p.add_argument("--engines", type=int, default=125, help="engines (half prefill, half decode)")
    p.add_argument("--tp", type=int, default=8, help="ranks per engine (one agent each)")
    p.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="processes hosting the agents (default: one per CPU the load runs on; "
        "more only add scheduling delay to every order's latency)",
    )
    p.add_argument("--replicas", type=int, default=2, help="coordinator replicas")
    p.add_argument(
        "--leader-cpus",
        type=int,
        default=1,
        help="CPUs the leader is pinned to, the first this process may run on; the load "
        "gets the others (default 1)",
    )
    p.add_argument(
        "--leader-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replicas serve /metrics, as in production, and each step reads the "
        "leader's own share of the order latency from it (order residence, event-loop lag)",
    )
    p.add_argument(
        "--lease-s",
        type=int,
        default=2,
        help="the replicas' --etcd-lease-s (pushkv coordinator's default; at 1 s a "
        "saturated leader on a small host misses renewals and steps down)",
    )
    p.add_argument(
        "--etcd-members",
        type=int,
        choices=(1, 3),
        default=1,
        help="etcd members on loopback (3: a cluster, as in production; the replicas get all)",
    )
    p.add_argument("--start-rate", type=float, default=200.0, help="first offered rate (/s)")
    p.add_argument("--factor", type=float, default=1.5, help="rate growth per step")
    p.add_argument("--max-rate", type=float, default=50_000.0)
    p.add_argument("--max-steps", type=int, default=10, help="0: no load (registration, failover)")
    p.add_argument("--recheck", type=int, default=1, help="rerun a saturated step once (0: no)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds per step")
    p.add_argument("--drain-s", type=float, default=15.0, help="max wait for a backlog")
    p.add_argument("--max-outstanding", type=int, default=4000, help="per host")
    p.add_argument("--step-ms", type=float, default=10.0, help="engines submit once per this")
    p.add_argument("--idle-s", type=float, default=5.0, help="heartbeat-load interval")
    p.add_argument("--start-spread-s", type=float, default=1.0, help="ranks start within this")
    p.add_argument("--deadline-s", type=float, default=60.0, help="bound of every wait")
    p.add_argument(
        "--failure",
        choices=("kill", "freeze"),
        default="kill",
        help="how the leader fails: kill -9, or freeze (SIGSTOP: its connections stay "
        "open and silent, so the agents leave it after a lease of silence; it is "
        "thawed once they followed, and must exit without ordering)",
    )
    p.add_argument(
        "--relay",
        action="store_true",
        help="each engine's ranks reach the coordinators through one node relay "
        "(pushkv/relay/upstream.py, in the host process): one NodeStream per engine",
    )
    p.add_argument(
        "--submit-direct",
        action="store_true",
        help="with --relay: the engines' Submits as RPCs of their own to the leader, "
        "not up their relay's stream (the connector's submit_through_relay false)",
    )
    return p


def default_hosts(leader_cpus: int = 1) -> int:
    """One host process per CPU left to the load (the leader has its own).
    On a small box more processes than CPUs only queue for them: at 25
    rendezvous/s the order p50 was 2.1-2.4 ms with one process, 2.5-2.8 ms
    with two and 3.1-5.5 ms with four, all on the one CPU left
    (docs/benchmarks.md, "How many host processes")."""
    _, load = cpu_split(leader_cpus)
    return max(1, len(load) if load else (os.cpu_count() or 1))


def final_line(res: Result) -> str:
    sat = res.saturation.completed_per_s if res.steps else math.nan
    p99 = percentile(res.half.order_ms, 99) if res.half is not None else math.nan
    fo = res.failover
    return (
        f"agents={res.agents} rendezvous_per_s={sat:.0f} order_p99_ms={p99:.2f} "
        f"failover_s={fo.failover_s:.3f} agents_followed_s={fo.followed_s:.3f}"
    )


def summary(res: Result, hosts: int) -> list[str]:
    i, fo = res.idle, res.failover
    out = [
        f"summary: {res.agents} simulated agents (move no bytes) in {hosts} processes, same host",
        f"  registration: every agent welcomed by the leader {res.registered_s:.2f} s after start",
        f"  heartbeat load (idle, {i.seconds:.1f} s): {i.received_per_s:.0f} agent messages/s "
        f"to the leader ({i.acks_per_s:.0f} heartbeat acks/s), leader CPU "
        f"{i.leader_cpu * 100:.1f}%, hosts CPU {i.host_cpu * 100:.0f}%, leader RSS "
        f"{i.rss_mib:.0f} MiB",
    ]
    if res.connections:
        out.append(
            f"  connections to the leader's port, idle: {res.connections} "
            "(each rank, relay and engine client on one of its own)"
        )
    if res.steps:
        sat = res.saturation
        k = res.steps.index(sat)
        hcpu = res.host_cpu[k] if k < len(res.host_cpu) else math.nan
        to, back = res.msgs[k] if k < len(res.msgs) else (math.nan, math.nan)
        bound = "" if res.saturated else "at least "
        if res.leader_cpus > 1:
            lcpu = f"{sat.coord_cpu:.2f} cores of its {res.leader_cpus}"
        else:
            lcpu = f"{sat.coord_cpu * 100:.0f}% of its core"
        out.append(
            f"  rendezvous: {bound}{sat.completed_per_s:.0f}/s (offered {sat.offered:.0f}/s, "
            f"leader CPU {lcpu}, hosts CPU {hcpu * 100:.0f}% "
            f"of one core); {to:.0f} agent messages/s to the leader, {back:.0f}/s from it"
        )
        if sat.completed_per_s > 0:
            per_rdv = sat.coord_cpu / sat.completed_per_s * 1e3
            out.append(
                f"  leader CPU per rendezvous {per_rdv:.2f} ms, at {sat.calls_per_rpc:.1f} calls "
                "per Submit (`pushkv bench transport`: the gRPC floor per RPC and message)"
            )
        if not res.saturated:
            out.append("  (a lower bound: the ramp ended at --max-steps or --max-rate)")
        # Not bound: the leader (one process, one event loop) not near a whole core.
        if res.saturated and sat.coord_cpu < 0.8:
            out.append(
                "  the leader was not CPU-bound at saturation: the simulated agents and "
                "clients on the same host limit this figure"
            )
    if res.half is not None:
        h = res.half
        out.append(
            f"  order latency at {h.offered:.0f}/s: p50 {percentile(h.order_ms, 50):.2f} ms, "
            f"p99 {percentile(h.order_ms, 99):.2f} ms ({len(h.order_ms)} transfers)"
        )
        out.append(
            f"  of which the simulated agents' hosts: their event loops ran a "
            f"{LAG_TICK_S * 1000:.0f} ms timer late by p50 {percentile(h.loop_lag_ms, 50):.2f} "
            f"ms, p99 {percentile(h.loop_lag_ms, 99):.2f} ms meanwhile"
        )
        if h.leader is not None:
            ld = h.leader
            out.append(
                f"  of which the leader (its /metrics): {ld.orders} orders waited in it "
                f"p50 {ld.residence_p50_ms:.2f} ms, p99 {ld.residence_p99_ms:.2f} ms; its "
                f"event loop ran a {LAG_TICK_S * 1000:.0f} ms timer late by p50 "
                f"{ld.lag_p50_ms:.2f} ms, p99 {ld.lag_p99_ms:.2f} ms ({ld.lag_samples} samples; "
                "estimated from histogram buckets)"
            )
    out.append(f"  leader RSS after the load {res.loaded_rss_mib:.0f} MiB")
    how = "kill -9" if fo.how == "kill" else "SIGSTOP (frozen)"
    out.append(
        f"  {how} of the leader {fo.old}: {fo.new} led after {fo.failover_s:.3f} s; "
        f"{fo.followed}/{res.agents} agents registered with it, the last after "
        f"{fo.followed_s:.3f} s (median {fo.follow_p50_s:.3f} s); {fo.hellos} streams "
        f"opened meanwhile, {fo.refused} refused or failed (jittered backoff)"
    )
    if fo.how == "freeze":
        out.append(
            f"  frozen leader: {fo.redirected} agent streams left for the leader another "
            f"replica named, {fo.silenced} for its silence; thawed, it exited with status "
            f"{fo.old_exit} (3: its leadership was lost)"
        )
    if res.relay:
        out.append(
            f"  relay: {res.node_streams} NodeStreams, {res.up_messages} NodeUp messages for "
            f"{res.agent_writes} agent messages and {res.relayed_submits} Submits"
        )
    if res.after is not None:
        a = res.after
        out.append(
            f"  against the new leader: {a.completed} rendezvous, {a.failed} failed, "
            f"drained={a.drained}"
        )
    checked = sum(s.checked for s in [*res.steps, *filter(None, [res.half, res.after])])
    wrong = sum(s.check_failed for s in [*res.steps, *filter(None, [res.half, res.after])])
    out.append(
        f"  spot check: {checked - wrong}/{checked} sampled transfers are COMPLETE per the leader"
        + ("  <-- MISCOUNTED" if wrong else "")
    )
    out.append(f"  {GOALS}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.submit_direct and not args.relay:
        parser.error("--submit-direct is a choice of --relay's (without it every Submit is direct)")
    cpus = len(os.sched_getaffinity(0))
    if not 1 <= args.leader_cpus < cpus:
        parser.error(
            f"--leader-cpus {args.leader_cpus}: this process may run on {cpus} CPUs, "
            "and the load needs at least one of them"
        )
    if args.hosts is None:
        args.hosts = default_hosts(args.leader_cpus)
    if args.quick:
        args.duration = min(args.duration, 3.0)
        args.drain_s = min(args.drain_s, 8.0)
        args.idle_s = min(args.idle_s, 3.0)
        args.max_steps = min(args.max_steps, 7)
    bench = ClusterBench(args, row)
    agents = args.engines * args.tp
    say(
        f"{agents} simulated agents ({args.engines} engines x {args.tp} ranks) in "
        f"{args.hosts} processes, {args.replicas} coordinator replicas on "
        f"{args.etcd_members}-member etcd; leader CPUs "
        f"{sorted(bench.coord_cpus or []) or 'any'}, everything else "
        f"{sorted(bench.load_cpus or []) or 'any'}"
        + ("; each engine's ranks through one node relay (--relay)" if args.relay else "")
        + (
            ", its Submits as RPCs of their own (--submit-direct)"
            if args.relay and args.submit_direct
            else ", its Submits up the relay's stream"
            if args.relay
            else ""
        )
    )
    say(header())
    t0 = time.monotonic()
    try:
        res = bench.run()
    finally:
        bench.stop()
    say()
    for line in summary(res, args.hosts):
        say(line)
    say(f"elapsed {time.monotonic() - t0:.0f} s")
    say(final_line(res))
    return 0 if res.failover.followed >= res.agents else 1


if __name__ == "__main__":
    raise SystemExit(main())
