"""An armed order inside the agent's NIXL thread (a real DataPlane over a real
NIXL endpoint): what may and may not fire it. The posting guards are the same
as for any order; these cases prove they hold for armed ones."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from pushkv.agent.dataplane import DataPlane
from pushkv.agent.messages import (
    CancelMsg,
    FireMsg,
    OrderMsg,
    Outbound,
    ReportStatus,
    Target,
    TermMsg,
    WriteReportMsg,
)
from pushkv.agent.nixl_adapter import NixlEndpoint
from pushkv.rules.block_groups import of
from tests.support.nixl_peer import regions_of
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(60)


class Plane:
    """A started prefill DataPlane whose lease the test controls."""

    def __init__(self) -> None:
        self.lease = True
        self.renewing = False  # lease out, stream open (agent/link.py lease_renewing)
        self.reports: list[Outbound] = []
        self._lock = threading.Lock()
        arrays = [np.zeros((8, 4096), dtype=np.uint8)]

        def factory() -> NixlEndpoint:
            ep = NixlEndpoint(f"armed-test-{uuid.uuid4().hex[:8]}")
            ep.register_kv(regions_of(arrays))
            return ep

        def report(m: Outbound) -> None:
            with self._lock:
                self.reports.append(m)

        self.dp = DataPlane(
            factory,
            is_prefill=True,
            emit_report=report,
            emit_event=lambda _e: None,
            lease_ok=lambda: self.lease,
            lease_renewing=lambda: self.renewing,
            tokens_per_block=16,
        )

    def outcome(self, order_id: str) -> WriteReportMsg:
        def found() -> WriteReportMsg | None:
            with self._lock:
                for m in self.reports:
                    if (
                        isinstance(m, WriteReportMsg)
                        and m.order_id == order_id
                        and m.status is not ReportStatus.POSTED
                    ):
                        return m
            return None

        wait_until(lambda: found() is not None, f"order {order_id} resolved")
        got = found()
        assert got is not None
        return got


@pytest.fixture
def plane() -> Iterator[Plane]:
    p = Plane()
    p.dp.start()
    yield p
    p.dp.stop()


def armed(oid: str, tid: str, term: int = 0) -> OrderMsg:
    tgt = Target("D", 0, "inc", of(), of((1, 2)), 1)
    return OrderMsg(oid, tid, 0, (tgt,), 4e9, term=term, num_tokens=20, armed=True)


def test_an_armed_order_never_fires_once_the_lease_lapsed(plane: Plane) -> None:
    plane.dp.inbox.put(armed("o1", "t1"))
    plane.lease = False
    plane.dp.inbox.put(FireMsg("t1", of((5, 6)), 20))
    out = plane.outcome("o1")
    assert out.status is ReportStatus.DROPPED and "lease lapsed" in out.detail
    assert plane.dp.writes_posted == 0


def settled(plane: Plane, marker: str) -> None:
    """Every step before this has run: a cancel of an order never received
    is answered in a later step of the NIXL thread."""
    plane.dp.inbox.put(CancelMsg(marker, marker))
    assert plane.outcome(marker).detail == "order never received"


def test_an_order_waits_while_the_lease_renews_then_posts(plane: Plane) -> None:
    """The lease ran out on a stream still open (a starved process): the
    fired order is held, neither posted nor dropped; once a heartbeat is
    answered (the lease runs again) it is posted. The peer is unknown here,
    so the post attempt fails: that it was tried is the point."""
    plane.lease, plane.renewing = False, True
    plane.dp.inbox.put(armed("o7", "t7"))
    plane.dp.inbox.put(FireMsg("t7", of((5, 6)), 20))
    settled(plane, "m1")
    assert plane.dp.orders_fired == 1 and plane.dp.fast_polling
    with plane._lock:
        assert not [m for m in plane.reports if getattr(m, "order_id", "") == "o7"]
    plane.lease = True
    out = plane.outcome("o7")
    assert out.status is ReportStatus.FAILED and "unknown" in out.detail


def test_an_order_held_for_a_renewal_is_dropped_once_the_stream_ends(plane: Plane) -> None:
    plane.lease, plane.renewing = False, True
    plane.dp.inbox.put(armed("o8", "t8"))
    plane.dp.inbox.put(FireMsg("t8", of((5, 6)), 20))
    settled(plane, "m2")
    plane.renewing = False  # the stream ended: the coordinator may have let the agent go
    out = plane.outcome("o8")
    assert out.status is ReportStatus.DROPPED and "lease lapsed" in out.detail
    assert plane.dp.writes_posted == 0


def test_an_armed_order_of_an_older_term_is_refused(plane: Plane) -> None:
    plane.dp.inbox.put(TermMsg(7))
    plane.dp.inbox.put(armed("o2", "t2", term=6))
    out = plane.outcome("o2")
    assert out.status is ReportStatus.DROPPED and "refused" in out.detail
    plane.dp.inbox.put(FireMsg("t2", of((5, 6)), 20))
    plane.dp.inbox.put(armed("o3", "t3", term=7))
    plane.dp.inbox.put(CancelMsg("o3", "t3", term=7))
    assert plane.outcome("o3").status is ReportStatus.DROPPED
    assert plane.dp.writes_posted == 0 and plane.dp.orders_fired == 0


def test_an_armed_order_past_its_deadline_is_not_posted(plane: Plane) -> None:
    late = armed("o4", "t4")
    plane.dp.inbox.put(
        OrderMsg(late.order_id, late.transfer_id, 0, late.targets, 1.0, num_tokens=20, armed=True)
    )
    plane.dp.inbox.put(FireMsg("t4", of((5, 6)), 20))
    out = plane.outcome("o4")
    assert out.status is ReportStatus.DROPPED and "deadline" in out.detail
    assert plane.dp.writes_posted == 0


def test_a_replayed_armed_order_fires_once(plane: Plane) -> None:
    """Replayed after a reconnect: still one order. The peer is unknown here,
    so the single post attempt fails; a second would report twice."""
    plane.dp.inbox.put(armed("o5", "t5"))
    plane.dp.inbox.put(armed("o5", "t5"))
    plane.dp.inbox.put(FireMsg("t5", of((5, 6)), 20))
    out = plane.outcome("o5")
    assert out.status is ReportStatus.FAILED and "unknown" in out.detail
    assert plane.dp.orders_fired == 1
    wait_until(plane.dp.inbox.empty, "the inbox drained")
    plane.dp.inbox.put(FireMsg("t5", of((5, 6)), 20))  # a second fire finds no order
    plane.dp.inbox.put(armed("o6", "t6"))
    plane.dp.inbox.put(CancelMsg("o6", "t6"))
    assert plane.outcome("o6").status is ReportStatus.DROPPED
    assert plane.dp.orders_fired == 1
    with plane._lock:
        assert sum(1 for m in plane.reports if getattr(m, "order_id", "") == "o5") == 1
