"""The host's bookkeeping hand-off to the agent's NIXL thread (DataPlane.from_host).

vLLM's engine thread appends `expect`/`hold` to a deque without a lock; the
NIXL thread drains it every step and is woken only while it sleeps longer than
a fast poll. These tests run a real DataPlane over a real NIXL endpoint.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from pushkv.agent import dataplane as dp_mod
from pushkv.agent.dataplane import DataPlane
from pushkv.agent.messages import ExpectMsg, HoldMsg
from pushkv.agent.nixl_adapter import NixlEndpoint
from tests.support.nixl_peer import regions_of
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(60)


def _plane(is_prefill: bool) -> tuple[DataPlane, list[np.ndarray]]:
    arrays = [np.zeros((4, 4096), dtype=np.uint8)]

    def factory() -> NixlEndpoint:
        ep = NixlEndpoint(f"host-test-{uuid.uuid4().hex[:8]}")
        ep.register_kv(regions_of(arrays))
        return ep

    plane = DataPlane(
        factory,
        is_prefill=is_prefill,
        emit_report=lambda _m: None,
        emit_event=lambda _e: None,
        lease_ok=lambda: True,
    )
    return plane, arrays


@pytest.fixture
def sleepy_decode_plane(monkeypatch: pytest.MonkeyPatch) -> Iterator[DataPlane]:
    """A started decode DataPlane whose idle sleep is a minute long."""
    monkeypatch.setattr(dp_mod, "IDLE_POLL_MAX_S", 60.0)
    plane, _arrays = _plane(is_prefill=False)
    plane._idle = 60.0  # skip the back-off: the first idle wait is the longest
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()
        assert not plane.alive


def test_only_an_expectation_wakes_and_only_a_sleeping_thread() -> None:
    plane, _arrays = _plane(is_prefill=False)  # not started: the protocol alone
    plane.from_host(ExpectMsg(("t1",)))
    assert plane.inbox.empty()  # awake (polling fast): no wake-up token
    plane._asleep = True
    plane.from_host(HoldMsg(("t2",)))
    assert plane.inbox.empty()  # a hold never wakes it
    plane.from_host(ExpectMsg(("t3",)))
    assert plane.inbox.qsize() == 1  # asleep: one token wakes it
    assert [m.transfer_ids for m in plane._host] == [("t1",), ("t2",), ("t3",)]


def test_hold_reaches_a_sleeping_thread_at_its_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dp_mod, "IDLE_POLL_MAX_S", 0.2)
    plane, _arrays = _plane(is_prefill=True)
    plane._idle = 0.2
    plane.start()
    try:
        wait_until(lambda: plane._asleep, "the NIXL thread goes to sleep")
        plane.from_host(HoldMsg(("tx-h",)))
        wait_until(lambda: plane._held == {"tx-h"}, "the hold is applied")
    finally:
        plane.stop()


def test_expectation_reaches_a_sleeping_thread_at_once(sleepy_decode_plane: DataPlane) -> None:
    plane = sleepy_decode_plane
    wait_until(lambda: plane._asleep, "the NIXL thread goes to sleep")
    # Without the wake-up the thread would sleep a whole minute, past the deadline.
    plane.from_host(ExpectMsg(("tx-1",)))
    wait_until(lambda: "tx-1" in plane._arrivals, "the expectation is applied")
    assert not plane._host


def test_hold_is_applied_while_the_thread_polls_fast() -> None:
    plane, _arrays = _plane(is_prefill=True)
    plane.start()
    try:
        plane.from_host(HoldMsg(("tx-a", "tx-b")))
        wait_until(lambda: plane._held == {"tx-a", "tx-b"}, "the hold is applied")
    finally:
        plane.stop()
