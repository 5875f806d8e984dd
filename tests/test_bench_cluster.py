"""`pushkv bench cluster` in short form: 64 simulated agents (8 engines x 8
ranks) in 2 processes, real etcd, two real coordinator replicas, one short
load step, a kill -9 of the leader. Asserts behaviour only (every agent
re-registered with the new leader, rendezvous completed before and after, the
final line's format); every wait in the bench is a poll under a deadline and
no figure is asserted."""

from __future__ import annotations

import argparse
import inspect
import os
import re
from typing import cast

import pytest

from pushkv.agent.link import CoordinatorLink
from pushkv.bench import cluster_agents
from pushkv.bench.cluster import build_parser, default_hosts, final_line, main, summary
from pushkv.bench.cluster_agents import engines
from pushkv.bench.cluster_runs import ClusterBench, Failover, Result
from pushkv.bench.coordinator_report import row
from pushkv.bench.coordinator_server import cpu_split
from pushkv.bench.coordinator_step import Step
from pushkv.harness.etcd import EtcdCluster
from pushkv.relay.server import RelaySettings
from tests.support.etcd import require_etcd

FINAL = re.compile(
    r"^agents=\d+ rendezvous_per_s=\d+ order_p99_ms=\d+\.\d\d "
    r"failover_s=\d+\.\d{3} agents_followed_s=\d+\.\d{3}$"
)


def test_sim_agents_back_off_as_the_agent_link_does() -> None:
    params = inspect.signature(CoordinatorLink.__init__).parameters
    assert params["backoff_min_s"].default == cluster_agents.BACKOFF_MIN_S
    assert params["backoff_max_s"].default == cluster_agents.BACKOFF_MAX_S
    # --relay: a rank's hello waits at its engine's Upstream as at `pushkv relay`.
    assert RelaySettings("x:1").hello_wait_s == cluster_agents.RELAY_HELLO_WAIT_S


def test_hosts_default_to_one_process_per_cpu_left_to_the_load() -> None:
    assert build_parser().parse_args([]).hosts is None  # main() resolves it
    cpus = len(os.sched_getaffinity(0))
    assert default_hosts() == (cpus - 1 if cpus > 1 else (os.cpu_count() or 1))


def test_the_leader_gets_the_first_cpus_and_the_load_the_rest() -> None:
    """--leader-cpus (default 1): the split takes the first CPUs for the leader."""
    assert build_parser().parse_args([]).leader_cpus == 1
    cpus = sorted(os.sched_getaffinity(0))
    lead, load = cpu_split(1)
    if len(cpus) > 1:
        assert lead == {cpus[0]} and load == set(cpus[1:])
    assert cpu_split(len(cpus)) == (None, None)  # the load would have none: nothing pinned
    assert default_hosts(len(cpus)) == (os.cpu_count() or 1)


def test_leader_cpus_that_leave_the_load_none_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    n = len(os.sched_getaffinity(0))
    for bad in (0, n):
        with pytest.raises(SystemExit) as exc:
            main(["--leader-cpus", str(bad)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"--leader-cpus {bad}: this process may run on {n} CPUs" in err, err


def test_engines_are_dealt_so_every_host_pairs_its_own() -> None:
    dealt = engines(125, 4)
    assert sum(len(p) + len(d) for p, d in dealt) == 125
    assert all(p and d for p, d in dealt)
    names = [e for p, d in dealt for e in (*p, *d)]
    assert len(set(names)) == 125
    with pytest.raises(ValueError):
        engines(3, 2)


def test_final_line_format() -> None:
    res = Result(agents=1000)
    res.steps = [Step(offered=100.0, completed_per_s=95.0)]
    res.half = Step(offered=50.0, order_ms=[1.0, 2.0])
    res.failover = Failover(failover_s=2.1, followed_s=3.4, followed=1000)
    line = final_line(res)
    assert FINAL.match(line), line
    assert line.startswith("agents=1000 rendezvous_per_s=95 ")


def run_cluster(args: argparse.Namespace) -> tuple[Result, str]:
    """One bench run, stopped after; its result and its printed summary."""
    bench = ClusterBench(args, row)
    try:
        res = bench.run()
    finally:
        bench.stop()
    text = "\n".join([*summary(res, args.hosts), final_line(res)])
    print(text)
    return res, text


@pytest.mark.faults
@pytest.mark.parametrize("relay", [False, True], ids=["direct", "through-node-relays"])
def test_small_cluster_follows_a_new_leader_after_kill_9(relay: bool) -> None:
    """With `--relay`, each engine's ranks are channels of one NodeStream
    (pushkv/relay/upstream.py); the Upstream follows the new leader and every rank's
    channel re-registers through it."""
    require_etcd()
    args = build_parser().parse_args(
        [
            *("--engines", "8", "--tp", "8", "--hosts", "2"),
            *(("--relay",) if relay else ()),
            # A 4 s TTL: a leader starved of CPU on a busy CI box (3 s without a
            # renewal) must not step down before the kill this test makes.
            *("--lease-s", "4"),
            *("--start-rate", "100", "--max-steps", "1", "--recheck", "0"),
            *("--duration", "1", "--idle-s", "0.5", "--drain-s", "20", "--deadline-s", "60"),
        ]
    )
    res, text = run_cluster(args)
    fo = res.failover
    assert res.agents == 64 and res.relay == relay
    # Every agent re-registered with the new leader after the kill -9.
    assert fo.new and fo.new != fo.old
    assert fo.followed == 64, text
    assert fo.failover_s > 0 and fo.followed_s >= fo.follow_p50_s > 0
    # Rendezvous completed against the first leader and against the new one.
    for step in [*res.steps, res.half, res.after]:
        assert step is not None
        assert step.completed > 0 and step.failed == 0 and step.drained, text
        assert step.check_failed == 0
        # Each host sampled its event loop's lag for the whole offer (1 s, a
        # 5 ms timer): about 200 samples per host, never negative.
        assert len(step.loop_lag_ms) >= 2 * 20 and min(step.loop_lag_ms) >= 0, text
        # The leader's own share, from its /metrics (the new leader's for
        # the step after the kill): orders handed to gRPC during the offer,
        # each of the step's rendezvous ordering 8 ranks, and its loop's lag.
        ld = step.leader
        assert ld is not None, text
        assert 0 < ld.orders <= 8 * step.issued, text
        assert 0 <= ld.residence_p50_ms <= ld.residence_p99_ms, text
        assert ld.lag_samples >= 20 and 0 <= ld.lag_p50_ms <= ld.lag_p99_ms, text
    # Every rank (direct) or relay has a TCP connection of its own to the
    # leader, as in a cluster, not one per host process.
    assert res.connections >= (8 if relay else 64), text
    lines = text.splitlines()
    assert any(line.startswith("  of which the simulated agents' hosts:") for line in lines)
    assert any(line.startswith("  of which the leader (its /metrics):") for line in lines)
    if relay:
        # The ranks' messages went up on the engines' NodeStreams (one per
        # engine, and at least one more each after the kill), several channels
        # per NodeUp.
        assert res.node_streams >= 2 * 8, text
        assert 0 < res.up_messages <= res.agent_writes, text
        # Every Submit went up the engines' streams (--relay's default), the
        # steps against the new leader above included.
        assert res.relayed_submits > 0, text
        assert any(line.startswith("  relay: ") for line in summary(res, args.hosts)), text
    assert FINAL.match(final_line(res)), final_line(res)


@pytest.mark.faults
@pytest.mark.parametrize("relay", [False, True], ids=["direct", "through-node-relays"])
def test_small_cluster_follows_a_frozen_leader(relay: bool) -> None:
    """`--failure freeze`: the leader is stopped with SIGSTOP, its connections
    open and silent. Every agent (or, with `--relay`, every NodeStream) leaves
    it once the standby names itself the leader, or after a lease of silence
    (agent/link.py's rules, pushkv/relay/upstream.py's), and re-registers with the
    new leader; thawed, the old one exits 3."""
    require_etcd()
    args = build_parser().parse_args(
        [
            *("--engines", "4", "--tp", "4", "--hosts", "1", "--failure", "freeze"),
            *(("--relay",) if relay else ()),
            *("--lease-s", "4", "--max-steps", "0", "--idle-s", "0.5", "--deadline-s", "60"),
        ]
    )
    res, text = run_cluster(args)
    fo = res.failover
    assert fo.how == "freeze" and fo.new and fo.new != fo.old, text
    assert fo.followed == res.agents == 16, text
    # Each of the 16 ranks' streams (with --relay: each of the 4 engines'
    # NodeStreams) was left, for the new leader the standby named or for the
    # silence; none kept waiting on it.
    assert fo.redirected + fo.silenced >= (4 if relay else 16), text
    assert fo.old_exit == 3, text
    assert any(line.startswith("  frozen leader: ") for line in text.splitlines()), text


def test_on_a_three_member_etcd_agents_follow_a_new_leader_after_kill_9() -> None:
    """`--etcd-members 3`: the replicas get all three members' URLs; the
    election and the failover run through a real three-member etcd."""
    require_etcd()
    args = build_parser().parse_args(
        [
            *("--engines", "4", "--tp", "4", "--hosts", "1", "--etcd-members", "3"),
            *("--lease-s", "4", "--max-steps", "0", "--idle-s", "0.5", "--deadline-s", "60"),
        ]
    )
    bench = ClusterBench(args, row)
    try:
        res = bench.run()
        assert isinstance(bench.etcd, EtcdCluster) and len(bench.etcd.live()) == 3
        urls = bench.etcd.urls
        # Popen.args is typed as any command form; the bench passes a list of str.
        assert all(
            r.proc and urls in " ".join(cast(list[str], r.proc.args)) for r in bench.replicas
        ), urls
    finally:
        bench.stop()
    text = "\n".join([*summary(res, args.hosts), final_line(res)])
    print(text)
    fo = res.failover
    assert fo.new and fo.new != fo.old and fo.followed == res.agents == 16, text
    assert fo.failover_s > 0
