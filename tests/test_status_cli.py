"""`pushkv status` against a real coordinator (tables and --json), and the timeline waits."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from pushkv.cli import main as cli
from pushkv.controlplane import timeline
from pushkv.tools import status as status_cli
from pushkv.tools import tables
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimCluster, ThreadedCoordinator, rendezvous

WAIT = 10.0
TIDS = ("s-1", "s-2", "s-3", "s-4")


async def _populate(address: str, cluster: SimCluster) -> None:
    """s-1 complete (decode first), s-2 complete (prefill first), s-3 cancelled, s-4 waiting."""
    await cluster.start()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pbg.TransferServiceStub(ch)
        await rendezvous(ch, "s-1", decode_first=True)
        await rendezvous(ch, "s-2", decode_first=False)
        await stub.RegisterDecodeBlocks(
            pb.RegisterDecodeBlocksRequest(
                transfer_id="s-3",
                decode_engine_id="d0",
                block_ids=[pb.BlockIds(ids=[4, 5, 6])],
                num_tokens=40,
            )
        )
        await stub.Cancel(pb.CancelRequest(transfer_id="s-3", reason="client went away"))
        await stub.RegisterDecodeBlocks(
            pb.RegisterDecodeBlocksRequest(
                transfer_id="s-4",
                decode_engine_id="d0",
                block_ids=[pb.BlockIds(ids=[10, 11, 12])],
                num_tokens=40,
            )
        )
        # Wait (deadline) until both rendezvous completed.
        watch = pbg.StatusServiceStub(ch).WatchTransfers(
            pb.WatchTransfersRequest(states=[pb.TRANSFER_STATE_COMPLETE], include_existing=True),
            timeout=WAIT,
        )
        done: set[str] = set()
        async for ev in watch:
            done.add(ev.transfer.transfer_id)
            if done >= {"s-1", "s-2"}:
                break
        watch.cancel()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ThreadedCoordinator, SimCluster]]:
    with ThreadedCoordinator() as tc:
        cluster = SimCluster(tc.address, auto_complete=True)
        tc.run(_populate(tc.address, cluster))
        yield tc, cluster
        tc.run(cluster.close())


@pytest.fixture
def addr(server: tuple[ThreadedCoordinator, SimCluster]) -> str:
    return server[0].address


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["status", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def rows(table: str) -> list[list[str]]:
    """Data rows of a tables._table rendering (after the header and the dashes)."""
    lines = table.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "}) + 1
    return [line.split() for line in lines[start:] if line and " of " not in line]


# ---------------------------------------------------------------- get


def test_get_table(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--coordinator", addr, "get", "s-1")
    assert rc == 0
    fields = dict(line.split(None, 1) for line in out.splitlines()[:3])
    assert fields == {"transfer": "s-1", "state": "complete", "reason": "-"}
    for wait in timeline.WAITS:
        assert any(line.split()[:1] == [wait] for line in out.splitlines()), wait
    stages = [line.split()[0] for line in out.splitlines() if line.split()[:1]]
    for stage in ("decode_registered", "prefill_done", "ordered", "write_posted", "arrived"):
        assert stage in stages
    rank_rows = [line.split() for line in out.splitlines() if line.startswith("0 ")]
    assert rank_rows and rank_rows[0][2:4] == ["done", "yes"]


def test_get_json_is_the_status_message(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--coordinator", addr, "get", "s-3", "--json")
    assert rc == 0
    t = json_format.Parse(out, pb.TransferStatus())
    assert t.transfer_id == "s-3" and t.state == pb.TRANSFER_STATE_CANCELLED
    assert t.reason == pb.REASON_CANCELLED and t.detail == "client went away"
    assert [e.stage for e in t.timeline][-1] == "cancelled"
    assert json.loads(out)["state"] == "TRANSFER_STATE_CANCELLED"


def test_get_unknown_transfer_fails_cleanly(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "--coordinator", addr, "get", "nope")
    assert rc == 1 and out == ""
    assert "NOT_FOUND" in err and "nope" in err


# ---------------------------------------------------------------- ls


def test_ls_table_and_filters(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--coordinator", addr, "ls")
    assert rc == 0
    header = out.splitlines()[0].split()
    assert header[:2] == ["TRANSFER", "STATE"] and "RDV_WAIT_MS" in header
    got = {r[0]: r[1] for r in rows(out)}
    assert got == {"s-1": "complete", "s-2": "complete", "s-3": "cancelled", "s-4": "registered"}
    assert out.rstrip().endswith("4 of 4 matching, newest first")

    _, out, _ = run(capsys, "--coordinator", addr, "ls", "--state", "complete")
    assert sorted(r[0] for r in rows(out)) == ["s-1", "s-2"]
    _, out, _ = run(capsys, "--coordinator", addr, "ls", "--state", "active")
    assert [r[0] for r in rows(out)] == ["s-4"]
    _, out, _ = run(capsys, "ls", "--state", "cancelled", "registered", "--coordinator", addr)
    assert sorted(r[0] for r in rows(out)) == ["s-3", "s-4"]
    _, out, _ = run(capsys, "--coordinator", addr, "ls", "--engine", "p0")
    assert sorted(r[0] for r in rows(out)) == ["s-1", "s-2"]
    _, out, _ = run(capsys, "--coordinator", addr, "ls", "--limit", "1")
    assert len(rows(out)) == 1 and "1 of 4 matching" in out


def test_ls_json(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--coordinator", addr, "--json", "ls", "--state", "terminal")
    assert rc == 0
    resp = json_format.Parse(out, pb.ListTransfersResponse())
    assert resp.total_matching == 3
    assert sorted(t.transfer_id for t in resp.transfers) == ["s-1", "s-2", "s-3"]


@pytest.mark.parametrize("wait", timeline.WAITS)
def test_ls_sort_by_any_wait(addr: str, capsys: pytest.CaptureFixture[str], wait: str) -> None:
    rc, out, _ = run(capsys, "--coordinator", addr, "ls", "--sort", wait, "--json")
    assert rc == 0
    got = list(json_format.Parse(out, pb.ListTransfersResponse()).transfers)
    values = [timeline.waits(t).get(wait) for t in got]
    present = [v for v in values if v is not None]
    assert present == sorted(present, reverse=True)
    assert values == present + [None] * (len(values) - len(present))  # None last

    _, out, _ = run(capsys, "--coordinator", addr, "ls", "--sort", wait, "--asc", "--json")
    asc = [
        timeline.waits(t).get(wait)
        for t in json_format.Parse(out, pb.ListTransfersResponse()).transfers
    ]
    assert [v for v in asc if v is not None] == sorted(present)

    _, out, _ = run(capsys, "--coordinator", addr, "ls", "--sort", wait)
    assert [r[0] for r in rows(out)] == [t.transfer_id for t in got]
    assert f"sorted by {wait} (descending)" in out


def test_ls_rejects_unknown_state_and_wait(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["ls", "--state", "bogus"], ["ls", "--sort", "bogus"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["status", *argv])
        assert exc.value.code == 2
    capsys.readouterr()


# ---------------------------------------------------------------- engines


def test_engines_table_and_json(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--coordinator", addr, "engines")
    assert rc == 0
    header = out.splitlines()[0].split()
    assert "SEEN_S_AGO" in header and "LEASE_LEFT_S" in header
    table = rows(out)
    assert [(r[0], r[1], r[2], r[4], r[5]) for r in table] == [
        ("d0", "decode", "0/1", "yes", "yes"),
        ("p0", "prefill", "0/1", "yes", "yes"),
    ]
    seen, left = header.index("SEEN_S_AGO"), header.index("LEASE_LEFT_S")
    assert [r[header.index("RELAY")] for r in table] == ["-", "-"]  # their own streams
    for r in table:
        assert float(r[seen]) >= -1.0  # client clock; same host here
        assert 0 < float(r[left]) <= 5.0

    rc, out, _ = run(capsys, "--coordinator", addr, "engines", "--role", "prefill", "--json")
    resp = json_format.Parse(out, pb.ListEnginesResponse())
    assert [e.engine_id for e in resp.engines] == ["p0"] and resp.engines[0].ready


# ---------------------------------------------------------------- overview


def test_status_alone_is_the_overview(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`pushkv status` without a command: the coordinator's role (a single
    one here), its engines, and its transfers in flight (s-4 waits; the
    others ended), as `ls --state active` counts them."""
    rc, out, _ = run(capsys, "--coordinator", addr)
    assert rc == 0, out
    leadership, engines, count = out.strip().split("\n\n")
    assert leadership.splitlines()[0].split() == ["REPLICA", "ROLE", "LEADER", "TERM", "ETCD"]
    assert rows(leadership) == [[addr, "single", "-", "-", "-"]]
    assert [(r[0], r[1]) for r in rows(engines)] == [("d0", "decode"), ("p0", "prefill")]
    _, listed, _ = run(capsys, "--coordinator", addr, "ls", "--state", "active")
    assert [r[0] for r in rows(listed)] == ["s-4"]
    assert count == "transfers in flight: 1"

    rc, out, _ = run(capsys, "--coordinator", addr, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["transfersInFlight"] == 1
    assert doc["replicas"] == [{"role": "LEADER_ROLE_SINGLE"}]
    assert sorted(e["engineId"] for e in doc["engines"]) == ["d0", "p0"]


def test_the_overview_of_no_coordinator_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "--coordinator", "127.0.0.1:1", "--timeout-s", "2")
    assert rc == 1 and out == ""
    assert err.startswith("pushkv status (overview): UNAVAILABLE"), err


def test_a_rank_within_its_reconnect_grace_shows_grace() -> None:
    """CONNECTED: yes; grace (its stream closed, the same agent may still say
    hello again: its engine stays READY); no."""
    from pushkv.tools import tables

    ranks = [
        pb.RankLease(tp_rank=0, incarnation="i1", connected=True),
        pb.RankLease(tp_rank=1, incarnation="i1", returning=True),
        pb.RankLease(tp_rank=2, incarnation="i1"),
    ]
    e = pb.EngineStatus(engine_id="p0", role=pb.ROLE_PREFILL, tp_size=3, ready=True, ranks=ranks)
    for table in (tables.engines_table([e]), tables.engine_leases_table([e], 0)):
        column = rows(table)[0].index("yes")  # CONNECTED, before READY
        header = table.splitlines()[0].split()
        assert header[column] == "CONNECTED", table
        assert [r[column] for r in rows(table)] == ["yes", "grace", "no"], table


# ---------------------------------------------------------------- watch


def test_watch_existing_with_count(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(
        capsys, "--coordinator", addr, "watch", "--existing", "--state", "complete", "--count", "2"
    )
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 2
    assert sorted(line.split()[1] for line in lines) == ["s-1", "s-2"]
    assert all(line.split()[2] == "complete" for line in lines)

    rc, out, _ = run(capsys, "--coordinator", addr, "--json", "watch", "--existing", "--count", "4")
    events = [json_format.Parse(line, pb.TransferEvent()) for line in out.splitlines()]
    assert sorted(e.transfer.transfer_id for e in events) == sorted(TIDS)


class LineSink:
    """A text stream that hands each written line to a queue; it can hang up."""

    def __init__(self, hang_up_after: str) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self._hang_up_after = hang_up_after

    def write(self, text: str) -> int:
        for line in text.splitlines():
            self.lines.put(line)
            if self._hang_up_after in line:
                raise BrokenPipeError  # like `pushkv status watch | head`
        return len(text)

    def flush(self) -> None:
        pass


def test_watch_streams_live_changes(
    server: tuple[ThreadedCoordinator, SimCluster], addr: str
) -> None:
    tc, _ = server
    sink = LineSink(hang_up_after="s-live  complete")
    result: list[Any] = []

    def watch() -> None:
        try:
            argv = ["--coordinator", addr, "watch", "--existing", "--engine", "d0"]
            result.append(status_cli.main(argv, out=sink))  # type: ignore[arg-type]
        except BaseException as exc:
            result.append(exc)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    # The replay of existing transfers proves the watch is registered.
    replayed = {sink.lines.get(timeout=WAIT).split()[1] for _ in TIDS}
    assert replayed == set(TIDS)

    async def live() -> None:
        async with grpc.aio.insecure_channel(addr) as ch:
            await rendezvous(ch, "s-live")

    tc.run(live())
    states: list[str] = []
    while not states or states[-1] != "complete":
        line = sink.lines.get(timeout=WAIT)
        if line.split()[1] == "s-live":
            states.append(line.split()[2])
    th.join(WAIT)
    assert result == [0]
    assert states[:2] == ["registered", "ordered"] and states[-1] == "complete"


# ---------------------------------------------------------------- timeline (pure)


def status(*events: tuple[str, float, int], created: float = 100.0) -> pb.TransferStatus:
    return pb.TransferStatus(
        transfer_id="x",
        created_unix_us=int(created * 1e6),
        timeline=[pb.TimelineEvent(stage=s, unix_us=int(at * 1e6), rank=r) for s, at, r in events],
    )


def test_waits_from_a_status() -> None:
    t = status(
        ("decode_registered", 100.0, -1),
        ("prefill_done", 100.5, -1),
        ("ordered", 100.501, -1),
        ("write_posted", 100.51, 0),
        ("write_posted", 100.52, 1),
        ("write_done", 100.6, 1),
        ("arrived", 100.61, 1),
        ("arrived", 100.65, 0),
        ("write_done", 100.7, 0),
        ("complete", 100.7, -1),
    )
    w = timeline.waits(t)
    assert w.rendezvous_wait == pytest.approx(0.5)  # decode registered first
    assert w.order_latency == pytest.approx(0.001)
    assert w.write_time == pytest.approx(0.199)
    assert w.arrival_lag == pytest.approx(-0.05)  # last arrival before the last done report
    assert w.total == pytest.approx(0.7)
    assert timeline.per_rank(timeline.events_of(t))[0] == {
        "write_posted": pytest.approx(100.51),
        "arrived": pytest.approx(100.65),
        "write_done": pytest.approx(100.7),
    }


def test_waits_prefill_first_and_incomplete() -> None:
    w = timeline.waits(status(("prefill_done", 100.0, -1), ("decode_registered", 100.25, -1)))
    assert w.rendezvous_wait == pytest.approx(-0.25)  # the prefill's KV waited
    assert (w.order_latency, w.write_time, w.arrival_lag, w.total) == (None, None, None, None)
    assert timeline.waits(status()).as_dict() == dict.fromkeys(timeline.WAITS)
    with pytest.raises(ValueError):
        timeline.waits(status()).get("bogus")


def table_cells(text: str) -> dict[str, str]:
    """The one row of a table of ops.tables, by column (cells may be empty)."""
    header, _, row = text.splitlines()
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
    bounds = zip(starts, [*starts[1:], None], strict=True)
    return {header[a:b].strip(): row[a:b].strip() for a, b in bounds}


def test_the_demos_table_times_an_armed_transfer() -> None:
    """The demos' table (ops.tables.transfers_table) shows the waits of
    controlplane/timeline.py: an armed order, which has no "ordered" stage,
    is timed from its first post, as `pushkv status ls` times it."""
    t = status(
        ("decode_registered", 100.0, -1),
        ("prefill_done", 100.5, -1),
        ("write_posted", 100.51, 0),
        ("write_done", 100.7, 0),
        ("arrived", 100.71, 0),
        ("complete", 100.71, -1),
    )
    t.state = pb.TRANSFER_STATE_COMPLETE
    cells = table_cells(tables.transfers_table([t]))
    assert cells["STATE"] == "complete"
    assert (cells["RDV_WAIT_MS"], cells["WRITE_MS"]) == ("500.0", "190.0")
    # Waits whose stages have not both happened yet.
    cells = table_cells(tables.transfers_table([status(("decode_registered", 100.0, -1))]))
    assert (cells["RDV_WAIT_MS"], cells["WRITE_MS"]) == ("-", "-")


def test_sort_by_wait_puts_missing_last() -> None:
    a = status(("decode_registered", 100.0, -1), ("prefill_done", 100.3, -1))
    b = status(("decode_registered", 100.0, -1), ("prefill_done", 100.1, -1))
    c = status(("decode_registered", 100.0, -1))
    a.transfer_id, b.transfer_id, c.transfer_id = "a", "b", "c"
    ids = [t.transfer_id for t in timeline.sort_by_wait([c, b, a], "rendezvous_wait")]
    assert ids == ["a", "b", "c"]
    ids = [
        t.transfer_id for t in timeline.sort_by_wait([c, a, b], "rendezvous_wait", descending=False)
    ]
    assert ids == ["b", "a", "c"]


def test_waits_agree_between_transfer_and_status(
    server: tuple[ThreadedCoordinator, SimCluster],
) -> None:
    tc, _ = server
    assert tc.coordinator is not None
    rt = tc.coordinator.runtime

    async def both() -> tuple[timeline.Waits, timeline.Waits]:
        t = rt.core.get("s-1")
        return timeline.waits(t), timeline.waits(rt.status(t))

    from_transfer, from_status = tc.run(both())
    for name in timeline.WAITS:
        a, b = from_transfer.get(name), from_status.get(name)
        assert a is not None and b is not None, name
        assert a == pytest.approx(b, abs=2e-6), name


def test_the_rules_terminal_stages_are_the_coordinators() -> None:
    """pushkv/rules/timeline.py spells the terminal states' stage names for the
    tools (which import no coordinator); they are the coordinator's own."""
    from pushkv.controlplane.domain import State
    from pushkv.rules.timeline import TERMINAL_STAGES

    assert frozenset(s.value for s in State if s.terminal) == TERMINAL_STAGES
