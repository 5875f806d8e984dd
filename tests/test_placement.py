"""Where pushkv's threads run (agent/placement.py; the connector's
`thread_cpus`). vLLM-CPU binds a worker's engine thread to its compute cores,
and Linux gives every thread it starts the same CPUs: by default ("auto") the
agent's threads (link, watchdog, NIXL, and the threads UCX and gRPC start
under them) may run on every CPU of the bound cores' NUMA nodes that the
cgroup allows instead.

The agents are real (pushkv/harness/kvhost.py: a real agent with real NIXL in its own
process, against a real coordinator process), bound as vLLM binds a worker,
and each thread's CPUs are read from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pushkv.agent.events import EventKind
from pushkv.agent.placement import (
    ROOT_CPUSET_FILES,
    auto_cpus,
    cgroup_cpus,
    check_setting,
    cpuset_files,
    launch_cpus,
    numa_nodes,
    numa_span,
    parse_cpu_list,
    placed,
    resolve,
    thread_cpus,
)
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.vllm_integration.settings import ConnectorSettings
from tests.support.kvpair import coord_fixture, prefill_done, register, stubs, wait_state  # noqa: F401

ALLOWED = cgroup_cpus()
BOUND = min(ALLOWED)  # the "compute core" a test binds the starting thread to


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpu_list(" 5 ") == {5}
    assert parse_cpu_list("1,1-2,") == {1, 2}
    for bad in ("", ",", "a", "3-1", "-1", "0-x", "1.5"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_the_setting_refuses_what_cannot_be_placed() -> None:
    assert check_setting("auto") == "auto"
    assert check_setting("inherit") == "inherit"
    assert check_setting(str(BOUND)) == str(BOUND)
    beyond = max(ALLOWED) + 1
    with pytest.raises(ValueError, match=rf"CPU\(s\) \[{beyond}\] .* not allowed"):
        check_setting(f"{BOUND},{beyond}")
    with pytest.raises(ValueError, match="not a CPU list"):
        check_setting("fast")
    # Refused where the engine reads its settings, naming the key.
    base = {"coordinator": "127.0.0.1:1", "routable": False}
    assert ConnectorSettings.from_extra_config(base).thread_cpus == "auto"
    with pytest.raises(ValueError, match="thread_cpus: CPU"):
        ConnectorSettings.from_extra_config({**base, "thread_cpus": str(beyond)})
    with pytest.raises(ValueError, match="thread_cpus: 'all' is not a CPU list"):
        ConnectorSettings.from_extra_config({**base, "thread_cpus": "all"})


# A child process, so that no thread of the test process is touched: its main
# thread bound as vLLM binds a worker's, a thread started inside `placed`.
PLACED_CHILD = """
import json, os, sys, threading
from pushkv.agent.placement import placed, resolve, thread_cpus
os.sched_setaffinity(0, {{{BOUND}}})
cpus = resolve(sys.argv[1], cpu_engine=sys.argv[2] == "cpu")
got = {{}}
with placed(cpus):
    t = threading.Thread(target=lambda: got.update(cpus=sorted(os.sched_getaffinity(0))))
    t.start()
t.join()
mine = sorted(os.sched_getaffinity(0))
print(json.dumps([mine, got["cpus"], None if cpus is None else sorted(cpus)]))
"""


@pytest.mark.parametrize(
    ("setting", "engine"), [("auto", "cpu"), ("auto", "gpu"), ("inherit", "cpu")]
)
def test_placed_threads_get_the_cpus_and_the_starter_keeps_its_own(
    setting: str, engine: str
) -> None:
    """On a CPU engine, auto widens the bound thread's CPUs to its NUMA nodes
    (within the cgroup); a GPU worker's binding (vLLM's --numa-bind) is kept."""
    script = PLACED_CHILD.format(BOUND=BOUND)
    out = subprocess.run(
        [sys.executable, "-c", script, setting, engine],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    starter, started, resolved = json.loads(out.stdout)
    assert starter == [BOUND]  # restored after the block
    span = numa_span(frozenset({BOUND}), numa_nodes() or [ALLOWED]) & ALLOWED
    if setting == "auto" and engine == "cpu" and len(span) > 1:
        assert resolved == sorted(span)
        assert started == sorted(span)
    else:
        assert resolved is None
        assert started == [BOUND]


# The engine started under `taskset -c BOUND` (or numactl): the launcher's
# CPUs, which its child (the worker) inherits and vLLM narrows no further.
LAUNCHER = """
import os, subprocess, sys
os.sched_setaffinity(0, {{{BOUND}}})
sys.exit(subprocess.run([sys.executable, "-c", *sys.argv[1:]]).returncode)
"""


@pytest.mark.parametrize("launched_on", ["bound", "all"])
def test_auto_keeps_the_threads_on_the_cpus_the_engine_was_started_on(launched_on: str) -> None:
    """A whole engine bound by its operator (taskset, numactl) keeps pushkv's
    threads inside that binding: auto widens only within the CPUs the
    engine's parent process runs on, and where that leaves nothing beyond the
    engine thread's own core, the threads stay with it."""
    if len(ALLOWED) < 2:
        pytest.fail(f"this test needs 2 CPUs, the cgroup allows {sorted(ALLOWED)}")
    span = numa_span(frozenset({BOUND}), numa_nodes() or [ALLOWED]) & ALLOWED
    if len(span) < 2:
        pytest.fail(f"this test needs 2 CPUs on CPU {BOUND}'s NUMA node: {sorted(span)}")
    child = [PLACED_CHILD.format(BOUND=BOUND), "auto", "cpu"]
    if launched_on == "bound":
        cmd = [sys.executable, "-c", LAUNCHER.format(BOUND=BOUND), *child]
    else:
        cmd = [sys.executable, "-c", *child]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    starter, started, resolved = json.loads(out.stdout)
    assert starter == [BOUND]
    if launched_on == "bound":
        assert (resolved, started) == (None, [BOUND])
    else:
        assert resolved == started == sorted(span)


def test_auto_widens_only_within_what_the_engine_was_given() -> None:
    nodes = [frozenset(range(8)), frozenset(range(8, 16))]
    # numactl --physcpubind=2-5 on an 8-CPU node, the engine thread on 2.
    assert auto_cpus(frozenset({2}), frozenset(range(2, 6)), nodes) == frozenset(range(2, 6))
    # Given only its own core: nothing to move to.
    assert auto_cpus(frozenset({2}), frozenset({2}), nodes) is None
    # A thread bound outside what it was given is not widened into it.
    assert auto_cpus(frozenset({9}), frozenset(range(8)), nodes) is None
    # Both nodes' cores bound: each node's CPUs that were given.
    assert auto_cpus(frozenset({1, 9}), frozenset(range(16)), nodes) == frozenset(range(16))
    # Unknown nodes: what was given.
    assert auto_cpus(frozenset({1}), frozenset({1, 3}), []) == frozenset({1, 3})
    # What the engine was started on: its parent's CPUs (here, pytest's launcher's).
    assert launch_cpus() == frozenset(os.sched_getaffinity(os.getppid()))


def test_an_unbound_thread_is_left_alone_by_auto() -> None:
    if frozenset(os.sched_getaffinity(0)) != ALLOWED:
        pytest.fail(f"the test process is bound: {os.sched_getaffinity(0)} of {ALLOWED}")
    assert resolve("auto", cpu_engine=True) is None  # nothing to move its threads off
    with placed(None):
        assert frozenset(os.sched_getaffinity(0)) == ALLOWED
    assert thread_cpus()[threading.get_native_id()] == ALLOWED


@pytest.mark.parametrize("setting", ["auto", "inherit", "explicit"])
def test_a_bound_agents_threads_are_placed_and_it_moves_bytes(
    coord: CoordinatorProcess, setting: str
) -> None:
    """A real agent started from a thread bound to one core: with "auto" every
    thread it started (its own, NIXL's, UCX's, gRPC's) may run on every CPU of
    the cgroup, with "inherit" only on that core, with a list exactly there;
    the starting thread keeps its core; and the placed agent pushes a
    transfer whose bytes arrive intact."""
    if len(ALLOWED) < 2:
        pytest.fail(f"this test needs 2 CPUs, the cgroup allows {sorted(ALLOWED)}")
    other = max(ALLOWED)
    value = {"auto": "auto", "inherit": "inherit", "explicit": str(other)}[setting]
    want = {"auto": sorted(ALLOWED), "inherit": [BOUND], "explicit": [other]}[setting]
    req, status = stubs(coord)
    p = KVHost(HostSpec(coord.address, "P", "prefill", bound_to=(BOUND,), thread_cpus=value))
    d = KVHost(HostSpec(coord.address, "D", "decode"))
    try:
        p.start()
        d.start()
        starter, started = p.call("threads")
        assert starter == [BOUND]
        # The link, its watchdog and the NIXL thread at least, with what they started.
        assert len(started) >= 3, started
        assert {tid: want for tid in started} == started
        src, dst = [3, 9, 4], [20, 2, 33]
        p.fill(src, seed=5)
        d.call("expect", ["t1"])
        register(req, "t1", dst, 40)
        prefill_done(req, "t1", src, 40)
        assert d.wait_event("t1").kind is EventKind.KV_READY
        assert d.check(dst, seed=5) == []
        assert wait_state(status, "t1", pb.TRANSFER_STATE_COMPLETE).state == (
            pb.TRANSFER_STATE_COMPLETE
        )
    finally:
        p.stop()
        d.stop()


def test_the_placement_bench_runs_both_settings_side_by_side(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`python -m pushkv.bench.thread_placement`, short: one trial of each setting."""
    from pushkv.bench.thread_placement import main

    main(["--runs", "1", "--seconds", "0.3"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"CPUs {sorted(ALLOWED)}; core 0 busy;")
    assert [ln.split()[0] for ln in out[1:3]] == ["inherit", "auto"]
    assert all(" p99 " in ln for ln in out[1:3])
    assert out[3].startswith("inherit/auto p50: ")


def test_the_cgroup_is_read_where_the_process_lives() -> None:
    v2 = cpuset_files("0::/kubepods/pod1/c1\n")
    assert v2[0] == Path("/sys/fs/cgroup/kubepods/pod1/c1/cpuset.cpus.effective")
    v1 = cpuset_files("4:memory:/x\n3:cpuset,cpu:/docker/abc\n0::/\n")
    assert v1[0] == Path("/sys/fs/cgroup/cpuset/docker/abc/cpuset.effective_cpus")
    assert v1[1] == Path("/sys/fs/cgroup/cpuset.cpus.effective")  # the hybrid's v2 line
    assert v1[-2:] == list(ROOT_CPUSET_FILES)
    # This process's: what the kernel lets it run on.
    assert frozenset(os.sched_getaffinity(0)) <= ALLOWED


def test_auto_widens_to_the_numa_nodes_of_the_bound_cpus() -> None:
    nodes = [frozenset(range(4)), frozenset(range(4, 8))]
    assert numa_span(frozenset({1}), nodes) == frozenset(range(4))
    assert numa_span(frozenset({3, 4}), nodes) == frozenset(range(8))
    assert numa_span(frozenset({9}), nodes) == {9}  # a CPU no node lists: itself
    assert numa_span(frozenset({2}), []) == {2}
    # This machine's nodes cover the CPUs its cgroup allows.
    assert frozenset().union(*numa_nodes()) >= ALLOWED
