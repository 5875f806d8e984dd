"""The agent's side of the failover rebuild (docs/reliability.md, "Failover rebuild").

A real agent in a KV host process (AgentConfig.rebuild_on_failover) against a
scripted coordinator (a real gRPC server in this process, tests/test_term_fencing.py):
it re-sends its live transfers in every hello; on a welcome from a newer leader
of the same cluster it refuses the old term's unposted orders and keeps its
blocks for that leader to adopt; term 0 (a single coordinator restarted) keeps
today's rule, and so does a lost leader nobody replaces within give_up_s.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from pushkv.agent.events import EventKind
from pushkv.agent.link_messages import HELLO_HELD_BYTES, held_entries
from pushkv.agent.snapshot import HeldItem
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.v1 import pushkv_pb2 as pb
from tests.test_term_fencing import (
    WAIT,
    ScriptedCoordinator,
    _pb_order,
    _welcome,
    _write_report,
    scripted,  # noqa: F401  (the fixture)
)

pytestmark = pytest.mark.timeout(120)


Stream = tuple[KVHost, "queue.Queue[pb.CoordinatorMessage | None]", "queue.Queue[Any]"]


def _started(
    servicer: ScriptedCoordinator,
    spec: HostSpec,
    term: int,
    cid: str,
    welcome: pb.CoordinatorMessage | None = None,
) -> Stream:
    """The host, registered with a scripted coordinator of `term` (or by
    `welcome`); its first stream."""
    host = KVHost(spec)
    starting = threading.Thread(target=host.start, daemon=True)  # waits for the welcome
    starting.start()
    hello, out, incoming = servicer.streams.get(timeout=60)
    assert list(hello.held) == []  # no term followed yet: nothing to re-send
    out.put(welcome or _welcome(term, cid))
    starting.join(60)
    assert host.agent_name
    return host, out, incoming


def _live(host: KVHost, tid: str) -> tuple[object, ...]:
    """The host's snapshot entry for `tid`, once there (the order reaches the
    NIXL thread through the link, unordered with the host's own calls)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        found = [h for h in host.call("held") if h[0] == tid]
        if found:
            return tuple(found[0])
    raise AssertionError(f"{tid} not in the snapshot within {WAIT} s")


def _lease_expired(tid: str) -> pb.CoordinatorMessage:
    """The leader's notice that `tid` failed when an agent's lease expired."""
    notice = pb.TransferNotice(
        transfer_id=tid,
        state=pb.TRANSFER_STATE_FAILED,
        reason=pb.REASON_AGENT_LOST,
        detail="lease expired",
    )
    return pb.CoordinatorMessage(notice=notice)


def _held(hello: pb.AgentHello) -> dict[str, tuple[list[str], list[str]]]:
    return {
        h.transfer_id: (list(h.posted_order_ids), list(h.unposted_order_ids)) for h in hello.held
    }


def test_a_newer_leader_adopts_what_the_hello_re_sent(
    scripted: tuple[ScriptedCoordinator, str],  # noqa: F811
) -> None:
    coord, address = scripted
    host, out, incoming = _started(coord, HostSpec(address, "P", "prefill", rebuild=True), 7, "l7")
    try:
        host.call("pause", True)  # the order waits in the queue
        host.call("hold", ["t-held"])
        out.put(_pb_order("q", 7))  # for transfer t-q
        assert _live(host, "t-q") == ("t-q", (), ("q",), ())

        out.put(None)  # the leader is gone: posting is held from now on
        hello, out, incoming = coord.streams.get(timeout=WAIT)
        host.call("pause", False)  # the host resumes; the loss still holds posting
        assert hello.term == 7 and not hello.held_tell_only
        assert _held(hello) == {"t-held": ([], []), "t-q": ([], ["q"])}
        # Still not posted: the next snapshot (taken after the resume) says so.
        assert ("t-q", (), ("q",), ()) in host.call("held")

        out.put(_welcome(8, "l8"))  # a newer leader of the same cluster
        r = _write_report(incoming)  # the old term's order: refused, never posted
        assert (r.order_id, r.status) == ("q", pb.WRITE_STATUS_DROPPED)
        assert r.detail == "refused: order of term 7, older than term 8"
        assert host.call("held") == [("t-held", (), (), ())]  # kept for the new leader
        assert host.call("writes_posted") == 0
        assert host.pending_events() == []  # nothing resolved locally
        # The new leader orders it once, with its term: posted (the peer is unknown here).
        out.put(_pb_order("q2", 8))
        r = _write_report(incoming)
        assert (r.order_id, r.status) == ("q2", pb.WRITE_STATUS_FAILED)
    finally:
        host.stop()


def _heartbeat_first(incoming: queue.Queue[Any]) -> tuple[int, list[str]]:
    """The next heartbeat's seq, and the kinds of what came before it."""
    before: list[str] = []
    while True:
        msg = incoming.get(timeout=WAIT)
        assert msg is not None, "the agent ended the stream"
        items = msg.batch.messages if msg.WhichOneof("kind") == "batch" else [msg]
        for item in items:
            kind = item.WhichOneof("kind")
            if kind == "heartbeat":
                return item.heartbeat.seq, before
            before.append(kind)


def test_the_same_leader_back_holds_posting_until_its_answer_to_the_hello_is_in(
    scripted: tuple[ScriptedCoordinator, str],  # noqa: F811
) -> None:
    """Back to the same leader after a loss, an order queued while posting was
    held belongs to a transfer that failed meanwhile (the agent's lease ran
    out there). The leader's welcome comes alone; the notice of that end
    follows it. Posting resumes only once a heartbeat sent after the welcome is
    answered, so the order is dropped, never posted. Before, posting resumed at
    the welcome and the order was posted into the freed decode blocks
    (tests/test_relay_faults.py failed so in CI, once in many runs)."""
    coord, address = scripted
    host, out, incoming = _started(coord, HostSpec(address, "P", "prefill", rebuild=True), 7, "l7")
    try:
        host.call("pause", True)  # the order waits in the queue
        out.put(_pb_order("q", 7))  # for transfer t-q
        assert _live(host, "t-q") == ("t-q", (), ("q",), ())
        out.put(None)  # the leader's stream is lost: posting is held
        hello, out, incoming = coord.streams.get(timeout=WAIT)
        assert _held(hello) == {"t-q": ([], ["q"])}
        host.call("pause", False)  # the host resumes; the loss still holds posting
        out.put(_welcome(7, "l7"))  # the same leader takes it back
        seq, before = _heartbeat_first(incoming)  # sent at once after the welcome
        assert "write" not in before, before  # nothing posted (or reported) yet
        out.put(_lease_expired("t-q"))  # what the hello called for
        out.put(pb.CoordinatorMessage(heartbeat_ack=pb.HeartbeatAck(seq=seq, lease_ms=60_000)))
        r = _write_report(incoming)
        assert (r.order_id, r.status) == ("q", pb.WRITE_STATUS_DROPPED), r
        assert r.detail == "transfer ended before posting"
        assert host.call("writes_posted") == 0
        e = host.wait_event("t-q", WAIT)
        assert e.kind is EventKind.BLOCKS_FREE and "dropped" in e.detail, e
        # Posting is held no longer: a new order of the same leader is posted
        # (it fails here: its decode peer is unknown to this scripted leader).
        out.put(_pb_order("q2", 7))
        r = _write_report(incoming)
        assert (r.order_id, r.status) == ("q2", pb.WRITE_STATUS_FAILED), r
    finally:
        host.stop()


def test_back_after_its_lease_lapsed_the_agent_posts_nothing_it_held(
    scripted: tuple[ScriptedCoordinator, str],  # noqa: F811
) -> None:
    """Back at the same leader after this agent's lease lapsed, an order
    queued while posting was held: the leader resolved that order when the
    lease ended (the engine was lost) and, here, says nothing of it, as when
    the hello's list was cut at its bound and left it out. The agent drops
    it at the welcome, never posts it; an order the leader sends after the
    welcome is kept, and posted once the leader's answer to the hello is in."""
    coord, address = scripted
    # A 1 s lease that no heartbeat ack renews (this script acks none).
    short = pb.Welcome(lease_ms=1000, heartbeat_interval_ms=60_000, coordinator_id="l7", term=7)
    spec = HostSpec(address, "P", "prefill", rebuild=True)
    host, out, incoming = _started(coord, spec, 7, "l7", pb.CoordinatorMessage(welcome=short))
    try:
        host.call("pause", True)  # the order waits in the queue
        out.put(_pb_order("q", 7))  # for transfer t-q
        assert _live(host, "t-q") == ("t-q", (), ("q",), ())
        out.put(None)  # the leader's stream is lost: posting is held
        _, out, incoming = coord.streams.get(timeout=WAIT)
        deadline = time.monotonic() + WAIT
        while host.call("lease_held"):
            assert time.monotonic() < deadline, "the agent's 1 s lease never lapsed"
        host.call("pause", False)
        out.put(_welcome(7, "l7"))  # the same leader takes it back
        # An order of the new lease, before the leader's answer is in: kept.
        out.put(_pb_order("q2", 7))
        r = _write_report(incoming)  # dropped at the welcome, before q2 came
        assert (r.order_id, r.status) == ("q", pb.WRITE_STATUS_DROPPED), r
        assert r.detail == "agent lease lapsed while the coordinator was unreachable; not posting"
        seq, before = _heartbeat_first(incoming)
        assert "write" not in before, before  # q2 waits for the answer
        assert host.call("writes_posted") == 0
        out.put(pb.CoordinatorMessage(heartbeat_ack=pb.HeartbeatAck(seq=seq, lease_ms=60_000)))
        r = _write_report(incoming)  # posted, then failed: no such peer here
        assert (r.order_id, r.status) == ("q2", pb.WRITE_STATUS_FAILED), r
    finally:
        host.stop()


def test_term_zero_a_restarted_coordinator_resolves_locally_as_before(
    scripted: tuple[ScriptedCoordinator, str],  # noqa: F811
) -> None:
    coord, address = scripted
    spec = HostSpec(address, "P", "prefill", rebuild=True)
    host, out, _ = _started(coord, spec, 0, "c1")
    try:
        host.call("hold", ["t-held"])
        assert host.call("held") == [("t-held", (), (), ())]
        out.put(None)
        hello, out, _ = coord.streams.get(timeout=WAIT)
        # Re-sent at term 0 too (the same coordinator tells again what ended);
        # a restarted one knows none of them, and its welcome says it restarted.
        assert [h.transfer_id for h in hello.held] == ["t-held"]
        out.put(_welcome(0, "c2"))  # no term: a restart, not a failover
        e = host.wait_event("t-held", WAIT)
        assert e.kind is EventKind.BLOCKS_FREE and "coordinator restarted" in e.detail
    finally:
        host.stop()


def test_no_leader_within_give_up_s_resolves_locally(
    scripted: tuple[ScriptedCoordinator, str],  # noqa: F811
) -> None:
    coord, address = scripted
    spec = HostSpec(address, "D", "decode", rebuild=True, give_up_s=1.0)
    host, out, _ = _started(coord, spec, 7, "l7")
    try:
        host.call("expect", ["t-exp"])
        assert host.call("held") == [("t-exp", (), (), ())]
        out.put(None)  # the leader is gone; the streams that follow get no welcome
        hello, _, _ = coord.streams.get(timeout=WAIT)
        assert [h.transfer_id for h in hello.held] == ["t-exp"]
        e = host.wait_event("t-exp", WAIT)
        assert e.kind is EventKind.KV_FAILED and "unreachable" in e.detail
        assert host.call("held") == []
    finally:
        host.stop()


def test_without_rebuild_the_hello_re_sends_only_to_be_told_and_a_new_leader_resolves_locally(
    scripted: tuple[ScriptedCoordinator, str],  # noqa: F811
) -> None:
    coord, address = scripted
    host, out, _ = _started(coord, HostSpec(address, "D", "decode", rebuild=False), 7, "l7")
    try:
        host.call("expect", ["t-told", "t-new"])
        out.put(None)  # the stream is lost; the same leader takes the agent back
        hello, out, _ = coord.streams.get(timeout=WAIT)
        assert hello.held_tell_only and hello.term == 7
        assert sorted(h.transfer_id for h in hello.held) == ["t-new", "t-told"]
        out.put(_welcome(7, "l7"))
        # What ended while the stream was lost: told again, acted on once.
        out.put(_lease_expired("t-told"))
        e = host.wait_event("t-told", WAIT)
        assert e.kind is EventKind.KV_FAILED and "lease expired" in e.detail
        assert [h[0] for h in host.call("held")] == ["t-new"]
        out.put(None)  # lost again; this time a newer leader answers
        hello, out, _ = coord.streams.get(timeout=WAIT)
        assert hello.held_tell_only and [h.transfer_id for h in hello.held] == ["t-new"]
        # Not adopted: resolved locally, as after a restart (decode: once no
        # lease of the old leader's can let a WRITE land, this one's 1 s).
        newer = pb.Welcome(lease_ms=1000, heartbeat_interval_ms=500, coordinator_id="l8", term=8)
        out.put(pb.CoordinatorMessage(welcome=newer))
        e = host.wait_event("t-new", WAIT)
        assert e.kind is EventKind.KV_FAILED
        assert host.call("held") == []
    finally:
        host.stop()


def test_a_hello_of_more_transfers_than_a_message_holds_is_cut_and_the_agent_registers(
    scripted: tuple[ScriptedCoordinator, str],  # noqa: F811
) -> None:
    """20,000 live transfers with 240-character ids: 5 MB of ids, more than
    the 4 MiB a coordinator receives. Uncut, the hello is refused at every
    reconnect and the agent never registers again."""
    coord, address = scripted
    host, out, _ = _started(coord, HostSpec(address, "P", "prefill", rebuild=True), 7, "l7")
    ids = [f"t{i:05d}-" + "x" * 234 for i in range(20_000)]
    try:
        host.call("hold", ids)
        deadline = time.monotonic() + WAIT
        while len(host.call("held")) < len(ids):
            assert time.monotonic() < deadline, "the host did not hold them all"
        out.put(None)  # the stream is lost: the next hello re-sends what fits
        hello, out, _ = coord.streams.get(timeout=WAIT)
        sent = [h.transfer_id for h in hello.held]
        assert set(sent) <= set(ids) and len(set(sent)) == len(sent)
        listed = sum(h.ByteSize() + 4 for h in hello.held)
        assert HELLO_HELD_BYTES - 300 < listed <= HELLO_HELD_BYTES
        assert hello.ByteSize() < 4 << 20
        out.put(_welcome(7, "l7"))  # the same leader takes it back
        assert host.call("term")[0] == 7
    finally:
        host.stop()


def _order_for(oid: str, tid: str, term: int = 7) -> pb.CoordinatorMessage:
    msg = _pb_order(oid, term)
    msg.order.transfer_id = tid
    return msg


@pytest.mark.parametrize("welcome", ["the same leader", "a newer leader adopting"])
def test_what_a_cut_hello_left_out_is_resolved_at_the_welcome(
    scripted: tuple[ScriptedCoordinator, str],  # noqa: F811
    welcome: str,
) -> None:
    """The leader that welcomes the agent back (or adopts its transfers) does
    not know those the hello left out, and may never tell of their end: the
    agent drops their unposted orders and frees their blocks at the welcome.
    Without this, their blocks stayed held on the prefill engine for good."""
    coord, address = scripted
    host, out, _ = _started(coord, HostSpec(address, "P", "prefill", rebuild=True), 7, "l7")
    ids = [f"t{i:05d}-" + "x" * 234 for i in range(6_000)]  # about 1.5 MB of ids
    try:
        host.call("pause", True)  # the order waits in the queue
        host.call("hold", ids)
        out.put(_order_for("o-last", ids[-1]))  # listed last: left out
        deadline = time.monotonic() + WAIT
        while (ids[-1], (), ("o-last",), ()) not in map(tuple, host.call("held")):
            assert time.monotonic() < deadline, "the order is not held unposted"
        assert len(host.call("held")) == len(ids)
        out.put(None)  # the stream is lost
        hello, out, incoming = coord.streams.get(timeout=WAIT)
        sent = {h.transfer_id for h in hello.held}
        assert 0 < len(sent) < len(ids) and ids[-1] not in sent and ids[0] in sent
        term = 7 if welcome == "the same leader" else 8
        out.put(_welcome(term, f"l{term}"))
        r = _write_report(incoming)
        assert r.order_id == "o-last" and r.status == pb.WRITE_STATUS_DROPPED, r
        assert "left out of the hello" in r.detail
        e = host.wait_event(ids[-2], WAIT)
        assert e.kind is EventKind.BLOCKS_FREE and "left out of the hello" in e.detail
        deadline = time.monotonic() + WAIT
        while {h[0] for h in host.call("held")} != sent:
            assert time.monotonic() < deadline, "the listed transfers are not all that is held"
        # An order for one left out comes later (it was live there): refused.
        out.put(_order_for("o-late", ids[-3], term))
        r = _write_report(incoming)
        assert r.order_id == "o-late" and r.status == pb.WRITE_STATUS_FAILED, r
        assert "released" in r.detail
    finally:
        host.stop()


def test_the_hello_lists_first_what_may_have_been_written() -> None:
    """Under the bound, posted orders and counted arrivals go first."""
    plain = [HeldItem(f"h{i}", unposted=(f"u{i}",)) for i in range(50)]
    posted = HeldItem("p", posted=("o1",))
    counted = HeldItem("c", counted=(0, 1))
    ready = HeldItem("r", ready=True)
    items = (*plain, ready, posted, counted)
    entries, left = held_entries(items, budget=3 * 24)
    first = [e.transfer_id for e in entries][:3]
    assert first[0] == "p" and sorted(first[1:]) == ["c", "r"]
    assert len(left) == len(items) - len(entries) and left
    assert set(left) | {e.transfer_id for e in entries} == {h.transfer_id for h in items}
    every, none_left = held_entries(items)
    assert none_left == [] and sorted(e.transfer_id for e in every) == sorted(
        h.transfer_id for h in items
    )
