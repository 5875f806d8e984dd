"""The decode agent's arrival counting (agent/arrivals.py): plain Python, and
what its hello re-sends as `ready` after a transfer was told KV_READY."""

from __future__ import annotations

import time

from pushkv.agent import arrivals
from pushkv.agent.arrivals import Arrivals
from pushkv.agent.events import EventKind
from pushkv.agent.notif import WriteNotif


def test_ready_once_every_writer_counted_and_re_sent_for_a_while() -> None:
    a = Arrivals()
    a.expect("t", time.monotonic())
    assert a.count(WriteNotif("t", 1, 2)) == ("t", 1, None)
    assert a.count(WriteNotif("t", 1, 2)) is None  # a duplicate
    assert a.ready(time.monotonic()) == [] and a.counted() == [("t", (1,))]
    assert a.count(WriteNotif("t", 0, 2)) == ("t", 0, EventKind.KV_READY)
    assert a.counted() == [] and a.told("t")
    assert a.ready(time.monotonic()) == [("t", (0, 1))]
    # Gone after READY_KEEP_S: a hello long after re-sends nothing.
    assert a.ready(time.monotonic() + arrivals.READY_KEEP_S + 1) == []


def test_failed_is_not_ready_and_the_memory_is_bounded() -> None:
    a = Arrivals()
    a.expect("f", time.monotonic())
    a.count(WriteNotif("f", 0, 2))
    a.tell("f")  # KV_FAILED
    assert a.told("f") and a.ready(time.monotonic()) == []
    a.tell("c", ready=True)  # KV_READY on the coordinator's COMPLETE notice
    assert a.ready(time.monotonic()) == [("c", ())]
    for i in range(arrivals.MAX_READY + 10):
        a.count(WriteNotif(f"t{i}", 0, 1))
    got = a.ready(time.monotonic())
    assert len(got) == arrivals.MAX_READY and got[-1][0] == f"t{arrivals.MAX_READY + 9}"
    assert ("c", ()) not in got  # the oldest went first
