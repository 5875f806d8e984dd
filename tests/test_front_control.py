"""What a replica tells its front processes (controlplane/front_host.py):
its view of the election and its order deadline, as FrontControl frames on
the front's stdin, applied to the front's own gate."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator

import pytest

from pushkv.controlplane.front import PartitionFront
from pushkv.controlplane.front_host import apply, control
from pushkv.controlplane.leadership import Leadership, NotLeader, Role, View
from pushkv.net.frames import read_frames
from pushkv.v1 import partition_pb2 as ppb

WRITE = "/pushkv.v1.TransferService/BeginTransfer"


def decoded(*frames: bytes) -> list[ppb.FrontControl]:
    async def read() -> list[ppb.FrontControl]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(frames))
        reader.feed_eof()
        return [ppb.FrontControl.FromString(d) async for got in read_frames(reader) for d in got]

    return asyncio.run(read())


def test_a_front_follows_the_replicas_view_and_deadline() -> None:
    gate = Leadership()
    now = time.monotonic()
    standby = View(Role.STANDBY, "10.0.0.1:50151", 7, "10.0.0.2:50151", "http://e:2379")
    leader = View(Role.LEADER, "10.0.0.2:50151", 9, "10.0.0.2:50151", "http://e:2379")
    msgs = decoded(
        control(standby, 0.0),
        control(leader, now + 5),
        control(None, now + 50),
        control(None, 0.0, silence=True),
    )
    apply(msgs[0], gate, None)
    assert gate.view == standby and not gate.may_order()
    with pytest.raises(NotLeader, match=re.escape("the leader is 10.0.0.1:50151 (term 7)")):
        gate.check_write(WRITE)
    apply(msgs[1], gate, None)
    assert gate.view == leader and gate.may_order() and gate.order_deadline == now + 5
    gate.check_write(WRITE)  # a leader takes writes
    apply(msgs[2], gate, None)  # a renewal moves the deadline on
    assert gate.order_deadline == now + 50
    assert msgs[3].silence and not msgs[3].HasField("view")


def test_a_front_past_its_deadline_orders_nothing() -> None:
    """A renewal that has not reached the front fences it early, never late."""
    gate = Leadership()
    leader = View(Role.LEADER, "a:1", 3, "a:1")
    (msg,) = decoded(control(leader, time.monotonic() - 1))
    apply(msg, gate, None)
    assert gate.view.role is Role.LEADER and not gate.may_order()


def test_the_single_coordinators_fronts_never_expire() -> None:
    gate = Leadership(View(Role.STANDBY))
    (msg,) = decoded(control(View(Role.SINGLE), math.inf))
    apply(msg, gate, None)
    assert gate.view.role is Role.SINGLE and gate.may_order()


def test_renewals_are_told_only_while_leading() -> None:
    """Leadership.on_extend: what the replica forwards to its fronts."""
    gate = Leadership(View(Role.STANDBY))
    told: list[float] = []
    gate.on_extend.append(told.append)
    gate.extend(100.0)
    assert told == []
    gate.update(View(Role.LEADER, "a:1", 3), order_deadline=10.0)
    gate.extend(20.0)
    gate.extend(15.0)  # an older renewal: the deadline never moves back
    assert told == [20.0, 20.0] and gate.order_deadline == 20.0


class _Recorder:
    """A partition connection that records what the front sends, and whether
    the front's gate was open when it did."""

    def __init__(self, gate: Leadership) -> None:
        self.gate = gate
        self.sent: list[tuple[int, bool]] = []

    def send(self, up: ppb.PartitionUp) -> None:
        self.sent.append((up.lead, self.gate.may_order()))

    async def downs(self) -> AsyncIterator[ppb.PartitionDown]:
        return
        yield


def test_a_leader_view_sends_the_term_down_the_fronts_own_connections_first() -> None:
    """The partitions hear the term on this front's connections before its
    gate lets an agent's hello through them (each connection is in order)."""
    gate = Leadership(View(Role.STANDBY))
    links = [_Recorder(gate), _Recorder(gate)]
    front = PartitionFront(links)
    (standby, leader) = decoded(
        control(View(Role.STANDBY, "b:1", 8), 0.0),
        control(View(Role.LEADER, "a:1", 9), time.monotonic() + 5),
    )
    apply(standby, gate, front)
    assert [link.sent for link in links] == [[], []]
    apply(leader, gate, front)
    assert [link.sent for link in links] == [[(9, False)], [(9, False)]]
    assert gate.may_order()


def test_a_stop_carries_its_grace() -> None:
    """The replica's stop: the front lets its calls finish within the grace;
    a stdin that ends without one (the replica gone) stops it at once."""
    (stop, plain) = decoded(control(None, 0.0, stop_grace_s=5.0), control(None, 1.0))
    assert stop.stop and stop.grace_s == 5.0 and not stop.HasField("view")
    assert not plain.stop and plain.grace_s == 0.0
