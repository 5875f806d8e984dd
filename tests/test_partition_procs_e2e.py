"""A coordinator with its state in partition processes (`--partition-procs`,
experimental): real agents with real NIXL in KV host processes, over gRPC, as
against the single-process coordinator (tests/test_agent_e2e.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.controlplane.partitions import partition_of
from pushkv.harness.coordinator import CoordinatorProcess, RelayProcess
from pushkv.harness.kvhost import KVHost
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support import waits
from tests.support.core_shapes import ids_in_partition
from tests.support.kvpair import (
    CANARY,
    NB,
    hosts,
    prefill_done,
    register,
    stop_all,
    stubs,
    wait_states,
)

K = 2
DEADLINE_S = 30.0
EXIT_PARTITION_LOST = 5  # controlplane/server.py


def _coord(fronts: int) -> CoordinatorProcess:
    return CoordinatorProcess(
        *("--partition-procs", str(K), "--lease-s", "2", "--heartbeat-interval-s", "0.5"),
        *("--fronts", str(fronts), "--log-level", "INFO"),
    ).start()


# Two fronts (`--fronts 2`): the replica's and one front process on its port;
# the kernel hands each new connection to one of them (SO_REUSEPORT).
@pytest.fixture(params=[1, 2], ids=["one-front", "two-fronts"])
def coord(request: pytest.FixtureRequest) -> Iterator[CoordinatorProcess]:
    c = _coord(request.param)
    yield c
    c.stop()


@pytest.fixture
def one_front() -> Iterator[CoordinatorProcess]:
    c = _coord(1)
    yield c
    c.stop()


def ended(status: pbg.StatusServiceStub, tid: str) -> pb.TransferStatus:
    """tid's status once terminal (watched through the front)."""
    terminal: set[int] = {pb.TRANSFER_STATE_COMPLETE, pb.TRANSFER_STATE_FAILED}
    t = wait_states(status, tid, terminal, DEADLINE_S)
    assert t.state in terminal, t
    return t


def test_tp2_kv_hosts_push_through_partition_processes(coord: CoordinatorProcess) -> None:
    """Two prefill and two decode ranks (agents on their own streams, through
    the front) and transfers in both partitions, in both arrival orders: the
    bytes arrive intact, nothing else is written, every transfer COMPLETE;
    the reads and a watch's replay merge both partitions."""
    req, status = stubs(coord)
    ps, ds = hosts(coord, tp=2)
    ids = [*ids_in_partition(0, 2, K, "pp"), *ids_in_partition(1, 2, K, "pp")]
    try:
        src, dst = [3, 17, 4], [50, 2, 33]
        for h in ds:
            h.call("canary", CANARY)
            h.call("expect", ids)
        for n, tid in enumerate(ids):
            for r, h in enumerate(ps):
                h.fill(src, seed=10 * n + r)
            if n % 2:
                prefill_done(req, tid, src, 40)
                register(req, tid, dst, 40)
            else:
                register(req, tid, dst, 40)
                prefill_done(req, tid, src, 40)
            for r, h in enumerate(ds):
                assert h.wait_event(tid).kind is EventKind.KV_READY
                assert h.check(dst, seed=10 * n + r) == []
            t = ended(status, tid)
            assert t.state == pb.TRANSFER_STATE_COMPLETE, t
            assert sorted(r.prefill_rank for r in t.ranks if r.arrived) == [0, 1]
        untouched = [b for b in range(NB) if b not in dst]
        for h in ds:
            assert h.call("check_canary", untouched, CANARY) == []

        listed = status.ListTransfers(pb.ListTransfersRequest(limit=100), timeout=5)
        assert listed.total_matching == len(ids)
        assert [t.transfer_id for t in listed.transfers] == ids[::-1]  # newest first
        engines = {e.engine_id: e for e in status.ListEngines(pb.ListEnginesRequest()).engines}
        assert {"P", "D"} <= set(engines) and all(e.ready for e in engines.values())
        assert [rl.relay for rl in engines["P"].ranks] == ["", ""]  # their own streams
        watch = status.WatchTransfers(
            pb.WatchTransfersRequest(include_existing=True), timeout=DEADLINE_S
        )
        try:  # both partitions' transfers, oldest first, as one coordinator's
            events = iter(watch)
            replay = [next(events).transfer for _ in ids]
        finally:
            watch.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs: unannotated
        assert [t.transfer_id for t in replay] == ids
        assert {t.state for t in replay} == {pb.TRANSFER_STATE_COMPLETE}

        # Each outcome is logged once, by the partition that holds the transfer.
        def outcomes() -> list[dict[str, Any]]:
            got = _logged(coord.log_text(), "transfer_complete")
            return got if len(got) >= len(ids) else []

        logged = waits.poll("every transfer's outcome logged", outcomes, DEADLINE_S)
        assert sorted(ln["transfer_id"] for ln in logged) == sorted(ids)
        for ln in logged:
            assert ln["process"] == f"partition-{partition_of(ln['transfer_id'], K)}", ln
    finally:
        stop_all(ps, ds)


def _logged(log: str, event: str) -> list[dict[str, Any]]:
    """The coordinator's JSON log lines (its own and its children's) of `event`."""
    lines = (json.loads(ln) for ln in log.splitlines() if ln.startswith("{") and event in ln)
    return [ln for ln in lines if ln.get("event") == event]


def _push_each(
    req: pbg.TransferServiceStub,
    status: pbg.StatusServiceStub,
    p: KVHost,
    d: KVHost,
    ids: list[str],
) -> None:
    """Each of `ids` in turn, prefill blocks [1, 2] into decode blocks [5, 6]:
    the bytes arrive intact and the transfer ends COMPLETE."""
    d.call("expect", ids)
    for n, tid in enumerate(ids):
        p.fill([1, 2], seed=n)
        register(req, tid, [5, 6], 20)
        prefill_done(req, tid, [1, 2], 20)
        assert d.wait_event(tid).kind is EventKind.KV_READY
        assert d.check([5, 6], seed=n) == []
        assert ended(status, tid).state == pb.TRANSFER_STATE_COMPLETE


def test_agents_through_a_node_relay_push_through_partition_processes(
    coord: CoordinatorProcess,
) -> None:
    """Both agents dial a node relay (`pushkv relay`), whose NodeStream the
    front serves: transfers in both partitions complete, bytes intact, and
    ListEngines names the relay for both ranks."""
    relay = RelayProcess(coord.address).start()
    req, status = stubs(coord)
    (p,), (d,) = hosts(relay)
    try:
        ids = [*ids_in_partition(0, 1, K, "rl"), *ids_in_partition(1, 1, K, "rl")]
        _push_each(req, status, p, d, ids)
        engines = status.ListEngines(pb.ListEnginesRequest(), timeout=5).engines
        assert all(rl.relay for e in engines for rl in e.ranks), engines
    finally:
        stop_all([p], [d])
        relay.stop()


def _children(pid: int, module: str = "") -> list[int]:
    """The children of `pid`; with `module`, those running `python -m module`."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(c) for c in path.read_text().split()]
    if module:
        kids = [k for k in kids if module.encode() in Path(f"/proc/{k}/cmdline").read_bytes()]
    return kids


def test_a_partition_process_killed_ends_the_coordinator(one_front: CoordinatorProcess) -> None:
    """kill -9 of one partition: its state is gone, so the coordinator ends
    (exit 5, the reason in its log) for its supervisor to restart, and its
    other partitions end with it."""
    coord = one_front
    assert coord.proc is not None
    kids = _children(coord.proc.pid)
    assert len(kids) == K, kids
    os.kill(kids[1], signal.SIGKILL)
    assert coord.proc.wait(DEADLINE_S) == EXIT_PARTITION_LOST, coord.log_text()[-3000:]
    assert "partition 1's connection ended" in coord.log_text()
    waits.poll("the other partition gone", lambda: waits.process_gone(kids[0]), DEADLINE_S)


def _leadership(address: str) -> pb.Leadership:
    """GetLeadership over a channel of its own: a new connection, which the
    kernel hands to one of the fronts listening on the port."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options=options) as ch:
        return pbg.StatusServiceStub(ch).GetLeadership(pb.GetLeadershipRequest(), timeout=5)


def test_front_processes_share_the_port_and_end_with_the_coordinator() -> None:
    """`--fronts 3`: new connections reach all three fronts (each answer
    names its front), each serving as the replica does; kill -9 of a front
    process ends the coordinator (exit 5, the front named in its log), its
    partitions and the other front; a SIGTERM stops every front and exits
    0; and a coordinator killed with -9 leaves no front behind."""
    coord = _coord(3)
    try:
        assert coord.proc is not None
        seen: dict[int, int] = {}
        for _ in range(60):  # each front missed: at most 3 * (2/3)^60, about 1e-10
            got = _leadership(coord.address)
            assert got.role == pb.LEADER_ROLE_SINGLE, got
            seen[got.front] = seen.get(got.front, 0) + 1
        assert set(seen) == {0, 1, 2}, seen
        started = _logged(coord.log_text(), "front_started")  # each front's lines say whose
        # Every line is JSON: no child is forked with gRPC's threads running,
        # whose fork handler wrote a plain text line per child into the log.
        assert [ln for ln in coord.log_text().splitlines() if not ln.startswith("{")] == []
        assert sorted((ln["process"], ln["index"]) for ln in started) == [
            ("front-1", 1),
            ("front-2", 2),
        ], started
        parts = _children(coord.proc.pid, "pushkv.controlplane.partition_host")
        fronts = _children(coord.proc.pid, "pushkv.controlplane.front_host")
        assert len(parts) == K and len(fronts) == 2, (parts, fronts)
        os.kill(fronts[0], signal.SIGKILL)
        assert coord.proc.wait(DEADLINE_S) == EXIT_PARTITION_LOST, coord.log_text()[-3000:]
        assert re.search(r"front process [12] ended \(exit code -9\)", coord.log_text())
        for pid in (*parts, fronts[1]):
            waits.poll(f"{pid} gone", partial(waits.process_gone, pid), DEADLINE_S)
    finally:
        coord.stop()
    coord = _coord(3)
    try:  # SIGTERM: each front stops with the replica's grace, then all end, exit 0
        assert coord.proc is not None
        kids = _children(coord.proc.pid)
        assert len(kids) == K + 2, kids
        coord.proc.send_signal(signal.SIGTERM)
        assert coord.proc.wait(DEADLINE_S) == 0, coord.log_text()[-3000:]
        assert "front_lost" not in coord.log_text()
        for pid in kids:
            waits.poll(f"{pid} gone", partial(waits.process_gone, pid), DEADLINE_S)
    finally:
        coord.stop()
    coord = _coord(2)
    try:
        assert coord.proc is not None
        kids = _children(coord.proc.pid)
        assert len(kids) == K + 1, kids
        coord.proc.kill()
        coord.proc.wait(DEADLINE_S)
        for pid in kids:  # PR_SET_PDEATHSIG
            waits.poll(f"{pid} gone", partial(waits.process_gone, pid), DEADLINE_S)
    finally:
        coord.stop()


def test_fronts_without_partition_processes_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pushkv.cli.main", "coordinator", "--port", "0", "--fronts", "2"],
        check=False,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode != 0
    assert "--fronts (experimental) needs --partition-procs" in done.stdout + done.stderr, done


def _spans(log: str) -> list[dict[str, Any]]:
    """The transfer spans a console exporter printed, one JSON object a line."""
    return [
        json.loads(line)
        for line in log.splitlines()
        if line.startswith("{") and '"name": "pushkv.transfer"' in line
    ]


def test_each_partition_traces_its_own_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    """PUSHKV_OTEL=1 with partition processes and two fronts: each transfer
    has exactly one span, from the partition that holds it (its
    `pushkv.partition`), with its stages to COMPLETE; the console exporter
    writes them to the coordinator's log (the partitions' stderr)."""
    monkeypatch.setenv("PUSHKV_OTEL", "1")
    monkeypatch.setenv("PUSHKV_OTEL_EXPORTER", "console")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: export promptly
    coord = _coord(2)
    req, status = stubs(coord)
    (p,), (d,) = hosts(coord)
    ids = [*ids_in_partition(0, 2, K, "tr"), *ids_in_partition(1, 2, K, "tr")]
    try:
        _push_each(req, status, p, d, ids)

        def all_traced() -> bool:
            return {s["attributes"]["pushkv.transfer_id"] for s in _spans(coord.log_text())} >= set(
                ids
            )

        waits.poll("every transfer's span exported", all_traced, DEADLINE_S)
        spans = _spans(coord.log_text())
        assert sorted(s["attributes"]["pushkv.transfer_id"] for s in spans) == sorted(ids)
        for s in spans:
            tid = s["attributes"]["pushkv.transfer_id"]
            assert s["attributes"]["pushkv.partition"] == partition_of(tid, K), s
            assert s["attributes"]["pushkv.state"] == "complete", s
            stages = [e["name"] for e in s["events"]]
            assert {"decode_registered", "prefill_done", "ordered", "arrived"} <= set(stages)
            assert stages[-1] == "complete", s
    finally:
        stop_all([p], [d])
        coord.stop()


def test_partitions_in_one_process_and_in_processes_together_are_refused() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pushkv.cli.main",
            "coordinator",
            "--port",
            "0",
            "--partition-procs",
            "2",
            *("--partitions", "2"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode != 0
    assert "--partitions and --partition-procs are one split" in done.stdout + done.stderr, done
