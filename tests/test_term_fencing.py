"""Term fencing (docs/reliability.md, "Term fencing").

The leader stamps its term on every welcome, order and cancel; an agent follows
the newest term it has seen in a welcome, refuses (and reports as refused)
orders and cancels of an older one, and refuses a coordinator whose welcome
carries an older term. Without --etcd every term is 0 and nothing changes.

Coordinator side: a real in-process coordinator and simulated agents. Agent
side: a real DataPlane over a real NIXL endpoint, and a real agent in a KV host
process against a scripted coordinator (a real gRPC server in this process).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest

from pushkv.agent.dataplane import DataPlane
from pushkv.agent.events import HostEvent
from pushkv.agent.messages import (
    CancelMsg,
    OrderMsg,
    Outbound,
    PauseMsg,
    ReportStatus,
    Target,
    TermMsg,
    WriteReportMsg,
)
from pushkv.agent.nixl_adapter import NixlEndpoint
from pushkv.controlplane.server import Coordinator, ServerSettings, start
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.rules.block_groups import of
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.nixl_peer import regions_of
from tests.support.sim_agent import SimAgent, SimCluster, rendezvous

pytestmark = pytest.mark.timeout(120)
WAIT = 20.0


# ---------------------------------------------------------------- coordinator side


@pytest.fixture
async def coord() -> AsyncIterator[Coordinator]:
    c = await start(ServerSettings(port=0))
    yield c
    await c.stop(0)


async def test_the_leader_stamps_its_term_on_welcomes_orders_and_cancels(
    coord: Coordinator,
) -> None:
    coord.runtime.term = 9  # what the election sets when this replica leads
    async with SimCluster(coord.address, auto_complete=False) as cluster:
        [p], [d] = cluster.prefill, cluster.decode
        assert p.welcome is not None and p.welcome.term == 9
        async with grpc.aio.insecure_channel(coord.address) as ch:
            await rendezvous(ch, "t")
            await p.expect("peer")
            order = await p.expect("order")
            assert order.term == 9
            await pbg.TransferServiceStub(ch).Cancel(pb.CancelRequest(transfer_id="t"))
            cancel = await p.expect("cancel_order")
            assert (cancel.order_id, cancel.term) == (order.order_id, 9)
        assert d.welcome is not None and d.welcome.term == 9


async def test_without_etcd_the_term_is_zero(coord: Coordinator) -> None:
    async with SimCluster(coord.address, auto_complete=False) as cluster:
        [p], _ = cluster.prefill, cluster.decode
        assert p.welcome is not None and p.welcome.term == 0
        async with grpc.aio.insecure_channel(coord.address) as ch:
            await rendezvous(ch, "t")
            await p.expect("peer")
            assert (await p.expect("order")).term == 0


async def test_a_leader_refuses_an_agent_that_has_seen_a_newer_term(coord: Coordinator) -> None:
    coord.runtime.term = 9
    agent = SimAgent(coord.address, "p0", "prefill")
    agent.hello.hello.term = 10  # a newer leader welcomed it: this one is stale
    with pytest.raises(AssertionError):
        await agent.start(timeout=WAIT)  # no welcome: the stream ends
    assert agent.code == grpc.StatusCode.UNAVAILABLE
    assert agent.details is not None and "newer leader" in agent.details
    await agent.close()

    same = SimAgent(coord.address, "p0", "prefill")
    same.hello.hello.term = 9  # the leader's own term: welcome
    welcome = await same.start(timeout=WAIT)
    assert welcome.term == 9
    await same.close()


# ---------------------------------------------------------------- agent side, one thread


@pytest.fixture
def prefill_plane() -> Iterator[tuple[DataPlane, queue.Queue[Outbound], list[HostEvent]]]:
    """A started prefill DataPlane over a real NIXL endpoint; reports in a queue."""
    arrays = [np.zeros((4, 4096), dtype=np.uint8)]

    def factory() -> NixlEndpoint:
        ep = NixlEndpoint(f"term-test-{uuid.uuid4().hex[:8]}")
        ep.register_kv(regions_of(arrays))
        return ep

    reports: queue.Queue[Outbound] = queue.Queue()
    events: list[HostEvent] = []
    plane = DataPlane(
        factory,
        is_prefill=True,
        emit_report=reports.put,
        emit_event=events.append,
        lease_ok=lambda: True,
    )
    plane.start()
    try:
        yield plane, reports, events
    finally:
        plane.stop()
        assert not plane.alive


def _order(oid: str, tid: str, term: int) -> OrderMsg:
    # The decode peer is unknown: an accepted order fails at posting (no WRITE).
    tgt = Target("D", 0, "nobody", of((0,)), of((0,)), 1)
    return OrderMsg(oid, tid, 0, (tgt,), 0.0, "", term)


def _report(reports: queue.Queue[Outbound]) -> WriteReportMsg:
    r = reports.get(timeout=WAIT)
    assert isinstance(r, WriteReportMsg)
    return r


def test_the_dataplane_refuses_orders_and_cancels_of_an_older_term(
    prefill_plane: tuple[DataPlane, queue.Queue[Outbound], list[HostEvent]],
) -> None:
    plane, reports, events = prefill_plane
    plane.inbox.put(TermMsg(7))
    plane.inbox.put(PauseMsg(True))  # accepted orders stay queued until resumed
    plane.inbox.put(_order("old", "t-old", 5))
    r = _report(reports)
    assert (r.order_id, r.status) == ("old", ReportStatus.DROPPED)
    assert r.detail == "refused: order of term 5, older than term 7"

    plane.inbox.put(_order("new", "t-new", 7))
    plane.inbox.put(CancelMsg("new", "t-new", 5))  # an old leader's cancel: ignored
    plane.inbox.put(_order("old2", "t-old2", 6))  # handled after the cancel (FIFO)
    r = _report(reports)
    assert (r.order_id, r.status) == ("old2", ReportStatus.DROPPED)
    assert r.detail.startswith("refused:")
    plane.inbox.put(PauseMsg(False))
    r = _report(reports)  # "new" survived the old cancel: it reached posting
    assert (r.order_id, r.status) == ("new", ReportStatus.FAILED)
    assert "unknown or fenced" in r.detail

    # Queued under term 7, then a welcome of term 8: never posted.
    plane.inbox.put(PauseMsg(True))
    plane.inbox.put(_order("queued", "t-q", 7))
    plane.inbox.put(TermMsg(8))
    plane.inbox.put(CancelMsg("never-sent", "t-x", 8))  # a sync point: reported at once
    r = _report(reports)
    assert (r.order_id, r.status, r.detail) == (
        "never-sent",
        ReportStatus.DROPPED,
        "order never received",
    )
    plane.inbox.put(PauseMsg(False))
    r = _report(reports)
    assert (r.order_id, r.status) == ("queued", ReportStatus.DROPPED)
    assert r.detail == "refused: order of term 7, older than term 8"
    assert plane.writes_posted == 0
    assert plane.orders_refused == 3 and plane.cancels_refused == 1
    # A refusal releases nothing: the newer leader governs those blocks. Only
    # "new" (accepted, then failed) freed its transfer.
    assert [e.transfer_id for e in events] == ["t-new"]


# ---------------------------------------------------------------- agent side, across processes


class ScriptedCoordinator(pbg.AgentServiceServicer):
    """An AgentService whose every stream the test drives: each new stream is
    put on `streams` as (hello, outgoing queue, incoming queue); the test puts
    CoordinatorMessages on the outgoing queue (None ends the stream) and reads
    the agent's messages from the incoming one."""

    def __init__(self) -> None:
        self.streams: queue.Queue[
            tuple[pb.AgentHello, queue.Queue[pb.CoordinatorMessage | None], queue.Queue[Any]]
        ] = queue.Queue()

    def AgentStream(
        self, request_iterator: Iterator[pb.AgentMessage], context: Any
    ) -> Iterator[pb.CoordinatorMessage]:
        first = next(request_iterator)
        out: queue.Queue[pb.CoordinatorMessage | None] = queue.Queue()
        incoming: queue.Queue[Any] = queue.Queue()

        def read() -> None:
            try:
                for msg in request_iterator:
                    incoming.put(msg)
            except grpc.RpcError:
                pass
            incoming.put(None)  # the agent ended the stream
            out.put(None)

        threading.Thread(target=read, daemon=True).start()
        self.streams.put((first.hello, out, incoming))
        while (msg := out.get()) is not None:
            yield msg

    def NodeStream(
        self, request_iterator: Iterator[pb.NodeUp], context: Any
    ) -> Iterator[pb.NodeDown]:
        """Not scripted: answered as the generated base class answers it."""
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details("Method not implemented!")
        raise NotImplementedError("Method not implemented!")


def _welcome(term: int, cid: str) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(
        welcome=pb.Welcome(
            lease_ms=60_000, heartbeat_interval_ms=1000, coordinator_id=cid, term=term
        )
    )


def _pb_order(oid: str, term: int) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(
        order=pb.TransferOrder(
            order_id=oid,
            transfer_id="t-" + oid,
            prefill_rank=0,
            targets=[
                pb.WriteTarget(
                    decode_engine_id="D",
                    decode_rank=0,
                    decode_incarnation="nobody",
                    src_blocks=[pb.BlockIds(ids=[0])],
                    dst_blocks=[pb.BlockIds(ids=[0])],
                    expected_writers=1,
                )
            ],
            term=term,
        )
    )


class WriteReports:
    """The write reports of one agent stream, in order: each batch unwrapped
    whole (an agent under load sends two reports queued together as one
    batch; taking only its first would lose the second), heartbeats skipped."""

    def __init__(self, incoming: queue.Queue[Any]) -> None:
        self._incoming = incoming
        self._pending: collections.deque[pb.WriteReport] = collections.deque()

    def next(self) -> pb.WriteReport:
        """The next report, within WAIT overall (heartbeats keep coming)."""
        deadline = time.monotonic() + WAIT
        while not self._pending:
            left = deadline - time.monotonic()
            assert left > 0, f"no write report within {WAIT} s"
            msg = self._incoming.get(timeout=left)
            assert msg is not None, "the agent ended the stream"
            items = msg.batch.messages if msg.WhichOneof("kind") == "batch" else [msg]
            self._pending.extend(i.write for i in items if i.WhichOneof("kind") == "write")
        return self._pending.popleft()


# One reader per agent stream's queue, so that what a batch held beyond the
# report asked for waits for the next call.
_READERS: weakref.WeakKeyDictionary[queue.Queue[Any], WriteReports] = weakref.WeakKeyDictionary()


def _write_report(incoming: queue.Queue[Any]) -> pb.WriteReport:
    """The next write report on the stream (`WriteReports`, per queue)."""
    reader = _READERS.get(incoming)
    if reader is None:
        reader = _READERS[incoming] = WriteReports(incoming)
    return reader.next()


@pytest.fixture
def scripted() -> Iterator[tuple[ScriptedCoordinator, str]]:
    servicer = ScriptedCoordinator()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pbg.add_AgentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_an_agent_process_refuses_old_term_orders_and_stale_leaders(
    scripted: tuple[ScriptedCoordinator, str],
) -> None:
    servicer, address = scripted
    host = KVHost(HostSpec(address, "P", "prefill"))
    starting = threading.Thread(target=host.start, daemon=True)  # waits for the welcome
    starting.start()
    try:
        hello, out, incoming = servicer.streams.get(timeout=60)
        assert hello.term == 0  # nothing seen yet
        out.put(_welcome(7, "leader-7"))
        starting.join(60)
        assert host.agent_name

        host.call("pause", True)  # accepted orders wait in the queue
        out.put(_pb_order("old", 5))
        out.put(_pb_order("new", 7))
        out.put(
            pb.CoordinatorMessage(
                cancel_order=pb.CancelOrder(order_id="new", transfer_id="t-new", term=5)
            )
        )
        out.put(_pb_order("old2", 6))  # handled after the cancel: a sync point
        r = _write_report(incoming)
        assert (r.order_id, r.status) == ("old", pb.WRITE_STATUS_DROPPED)
        assert r.detail == "refused: order of term 5, older than term 7"
        r = _write_report(incoming)
        assert (r.order_id, r.status) == ("old2", pb.WRITE_STATUS_DROPPED)
        host.call("pause", False)
        r = _write_report(incoming)  # the old cancel did not drop it: it was posted
        assert (r.order_id, r.status) == ("new", pb.WRITE_STATUS_FAILED)
        assert host.call("writes_posted") == 0

        # The stream ends; the agent comes back saying which term it follows.
        out.put(None)
        hello, out, incoming = servicer.streams.get(timeout=WAIT)
        assert hello.term == 7
        out.put(_welcome(3, "stale-3"))  # an older leader: the agent hangs up
        assert incoming.get(timeout=WAIT) is None
        hello, out, incoming = servicer.streams.get(timeout=WAIT)
        assert hello.term == 7
        out.put(_welcome(8, "leader-8"))  # a newer one: followed
        out.put(_pb_order("seven", 7))
        r = _write_report(incoming)
        assert (r.order_id, r.status) == ("seven", pb.WRITE_STATUS_DROPPED)
        assert r.detail == "refused: order of term 7, older than term 8"
    finally:
        host.stop()
