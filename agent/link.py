"""The coordinator link: the one thread that owns the agent's gRPC stream.

It registers (hello), heartbeats, forwards reports from the NIXL thread, turns
coordinator messages into plain commands for the NIXL thread, and reconnects
with jittered exponential backoff, re-registering with the same incarnation.

An agent given a `snapshot` re-sends its live transfers in every hello: the
same leader, taking it back, tells it again of those that ended while its
stream was lost, after its welcome: posting stays held until a heartbeat sent
after that welcome is answered, so nothing of a transfer that ended is posted
in between (`CoordinatorBackMsg` waits for the ack). A rebuilding agent
(`rebuild`), on a welcome from a newer leader of the same cluster (a different
coordinator id, its previous term > 0 and the welcome's higher), lets that
leader adopt them (`CoordinatorAdoptedMsg`) instead of resolving them locally
(`CoordinatorChangedMsg`: term 0, a single coordinator restarted, or the
terms went back); one that does not marks its list `held_tell_only`, never
adopted. docs/reliability.md, "Failover rebuild".

A coordinator that says nothing for a whole lease is taken as gone, whatever
its connection says: a frozen or cut-off process keeps its sockets open and
silent, and a blocked read would wait on it for ever. The link's watchdog
thread then cancels the stream and the link dials the next address
(`pushkv/net/silence.py`). With several replicas the watchdog also asks another
replica which one leads, after two heartbeat intervals of silence (a hello
left unanswered: after a lease), and again each step: named elsewhere (with
a newer term, once welcomed), the link goes there at once.

The watchdog also tells a process that starves the agent (its wakes come late:
a core oversubscribed, a C call holding the GIL) from a silent coordinator,
and logs each such stall (`agent/starvation.py`).
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from pushkv.agent.link_messages import (
    HELLO_HELD_BYTES,
    held_entries,
    order_from_pb,
    peer_from_pb,
    report_to_pb,
)
from pushkv.agent.messages import (
    ArrivalMsg,
    CancelMsg,
    CoordinatorAdoptedMsg,
    CoordinatorBackMsg,
    CoordinatorChangedMsg,
    CoordinatorLostMsg,
    FencedMsg,
    Inbound,
    LeaseLapsedMsg,
    LeftOutMsg,
    NoticeMsg,
    Outbound,
    TermMsg,
    WriteReportMsg,
)
from pushkv.agent.snapshot import HeldItem
from pushkv.agent.starvation import StarvationWatch
from pushkv.net.codes import PERMANENT
from pushkv.net.leader import LeaderFollower, go_to
from pushkv.net.leader_ask import ask
from pushkv.net.silence import WATCH_S, SilenceWatch
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

log = logging.getLogger("pushkv.agent")

ARRIVAL_REPLAY_S = 30.0
# While a lapsed lease waits on an open stream, a heartbeat at most this often.
NUDGE_S = 0.2
# At most this many queued reports go out as one AgentMessage.batch.
MAX_OUT_BATCH = 256

ChannelFactory = Callable[[str], grpc.Channel]
# The NIXL thread's snapshot of the live transfers, within a deadline (None: late).
Snapshot = Callable[[float], tuple[HeldItem, ...] | None]
# How long a hello waits for that snapshot (the NIXL thread steps every <= 50 ms).
SNAPSHOT_WAIT_S = 5.0


class StaleLeaderError(Exception):
    """A coordinator welcomed the agent with an older term than the newest it
    has seen: it no longer leads (term fencing). The link tries another."""


class CoordinatorLink:
    def __init__(
        self,
        address: str,
        hello: pb.AgentHello,
        deliver: Callable[[Inbound], None],
        *,
        channel_factory: ChannelFactory | None = None,
        backoff_min_s: float = 0.05,
        backoff_max_s: float = 2.0,
        name: str = "pushkv-link",
        batching: bool = True,
        give_up_s: float = 30.0,
        snapshot: Snapshot | None = None,
        rebuild: bool = True,
        hang_dump_s: float = 0.0,
    ) -> None:
        self._give_up_s = give_up_s
        self._snapshot = snapshot  # set: hellos re-send the live transfers
        # And a newer leader adopts them (else they are only told again).
        self._rebuild = rebuild and snapshot is not None
        hello.held_tell_only = not self._rebuild
        self._lost = False  # the stream to a coordinator that welcomed us ended
        # The same coordinator welcomed us back: what it says of the hello's
        # held transfers (notices of those that ended meanwhile) follows the
        # welcome, so posting stays held until a heartbeat sent on this stream
        # is answered. The coordinator reads a stream in order: that ack comes
        # after everything the hello called for.
        self._back_pending = False
        self._left_out: tuple[str, ...] = ()  # the last hello's, until its welcome
        self._hb_now = threading.Event()  # heartbeat at once (the back barrier)
        self._nudged_at = 0.0  # the last heartbeat asked for by lease_renewing
        self._lost_since = 0.0
        # The newest leader term seen in a welcome (0: none, or no --etcd).
        # Orders and cancels of older terms are refused (agent/dataplane.py).
        self.term = 0
        self.stale_refused = 0  # welcomes refused for an older term
        # None only wakes the request stream (a heartbeat is due at once).
        self.outbox: queue.Queue[Outbound | None] = queue.Queue()
        # One coordinator address, or several (comma-separated) replicas: the
        # link dials the one leading (pushkv/net/leader.py).
        self._follower = LeaderFollower(address)
        # With batching, queued reports go up as one AgentBatch, and the
        # coordinator may send us CoordinatorBatch (hello.accepts_batches).
        self._batching = batching
        self._hello = pb.AgentHello()
        self._hello.CopyFrom(hello)
        self._hello.accepts_batches = batching
        self._deliver = deliver
        self._channel_factory = channel_factory or grpc.insecure_channel
        self._backoff = (backoff_min_s, backoff_max_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.registered = threading.Event()  # set on every Welcome, cleared on disconnect
        self.fatal_error = ""
        self.connects = 0
        self.coordinator_id = ""
        self._lease_until = 0.0
        self._lease_s = 5.0
        self._hb_interval_s = 1.0
        self._hb_sent: dict[int, float] = {}
        self._call: Any = None
        self._hello_sent = 0.0
        # A stream silent past the lease is cancelled (the watchdog thread).
        self._silence = SilenceWatch(self._lease_s)
        self.silenced = 0  # streams cancelled for silence (a figure for tests and logs)
        # Streams left because another replica named the leader elsewhere;
        # the link thread dials `_redirect` next.
        self.redirected = 0
        self._redirect = ""
        # Streams that ended since the last welcome, and when the first did:
        # the first is logged at INFO, the rest at DEBUG, and the welcome
        # that ends the run says how many and how long (a failover's refused
        # hellos are one line each, not one per attempt).
        self.failed_attempts = 0
        self._failing_since = 0.0
        self._watchdog = threading.Thread(target=self._watch, name=name + "-watch", daemon=True)
        # The watchdog's own: whether this process lets the agent's threads run.
        self.starvation = StarvationWatch(WATCH_S, dump_after_s=hang_dump_s)
        self._last_ack = 0.0  # when the last heartbeat ack came (for the lapse's log)
        self._recent_arrivals: collections.deque[tuple[float, ArrivalMsg]] = collections.deque()

    # ------------------------------------------------------------ public
    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout)
        self._watchdog.join(timeout)

    @property
    def address(self) -> str:
        """The coordinator address the link dials now."""
        return self._follower.current

    def lease_ok(self) -> bool:
        """True while the coordinator has acknowledged us within the lease."""
        return time.monotonic() < self._lease_until

    def lease_renewing(self) -> bool:
        """The lease ran out but the stream that held it is still open: this
        process starved the link (the coordinator keeps an agent whose
        connection answers pings, CoreSettings.silent_agent_s). A heartbeat
        goes at once; its answer renews the lease, and an ended stream makes
        it lapsed (the welcome back then drops what was held)."""
        if self._lost or not self.registered.is_set() or self._call is None:
            return False
        now = time.monotonic()
        if now - self._nudged_at >= NUDGE_S:  # the poster asks each poll: one heartbeat
            self._nudged_at = now
            self._hb_now.set()
            self.outbox.put(None)  # wakes the request stream
        return True

    def send(self, report: Outbound) -> None:
        self.outbox.put(report)

    # ------------------------------------------------------------ threads
    def _watch(self) -> None:
        """The watchdog: cancel a stream whose coordinator fell silent (the
        link thread then follows the next address, as after any lost stream),
        or one that another replica says no longer goes to the leader."""
        try:
            while not self._stop.wait(WATCH_S):
                self._watch_step()
                self.starvation.stepped()  # asking a replica is not a stall
        finally:
            self.starvation.close()

    def _watch_step(self) -> None:
        late = self.starvation.tick()
        if late:
            # Nothing could be read meanwhile: the coordinator's silence is ours.
            self._silence.excuse(late)
            log.warning(
                "the agent's threads could not run for %.1f s: this process starved them "
                "(its cores oversubscribed, or a C call holding the GIL); the coordinator "
                "hears no heartbeat meanwhile: past the lease (%.1f s) nothing is posted "
                "until a heartbeat is answered, and the orders held here are dropped if "
                "the coordinator let the agent go",
                late,
                self._lease_s,
            )
        call = self._call
        if call is None:
            return
        if self._silence.overdue():
            self.silenced += 1
            log.warning(
                "coordinator %s said nothing for %.1f s (the limit is %.1f s): "
                "taking it as gone, trying %s",
                self._follower.current,
                self._silence.silent_for(),
                self._silence.limit(),
                "another" if self._follower.several else "it again",
            )
            call.cancel()
            self._silence.started()  # once per stream: the link thread ends it now
            return
        if not self._follower.several or not self._silence.ask_due():
            return
        answered = self._silence.answered
        named, named_term = ask(
            self._follower.addresses,
            self._follower.current,
            self._channel_factory,
            self._stop.is_set,
        )
        leader = go_to(
            named,
            named_term,
            dialed=self._follower.current,
            answered=answered,
            term=self.term,
        )
        if not leader or self._call is not call:
            return  # stay (pushkv/net/leader.go_to), or the stream moved on meanwhile
        self.redirected += 1
        log.warning(
            "coordinator %s has %s in %.1f s and another replica names %s "
            "(term %d) as the leader: going there",
            self._follower.current,
            "said nothing" if answered else "not answered the hello",
            self._silence.silent_for(),
            leader,
            named_term,
        )
        self._redirect = leader
        call.cancel()
        self._silence.started()

    def _run(self) -> None:
        delay = self._backoff[0]
        while not self._stop.is_set():
            channel = self._channel_factory(self._follower.current)
            try:
                self._session(channel)
                delay = self._backoff[0]
            except StaleLeaderError as exc:
                self.stale_refused += 1
                log.warning("%s; trying another coordinator", exc)
                self._follower.follow()
            except grpc.RpcError as exc:
                call: Any = exc
                code = call.code() if hasattr(call, "code") else None
                if code in PERMANENT:
                    details = call.details() if hasattr(call, "details") else str(exc)
                    self.fatal_error = f"{code}: {details}"
                    log.error("coordinator rejected this agent: %s", self.fatal_error)
                    delay = self._backoff[1]
                elif not self._stop.is_set():
                    if not self.failed_attempts:
                        self._failing_since = time.monotonic()
                    self.failed_attempts += 1
                    (log.info if self.failed_attempts == 1 else log.debug)(
                        "coordinator stream to %s ended (%s); reconnecting",
                        self._follower.current,
                        code,
                    )
                    redirect, self._redirect = self._redirect, ""
                    if redirect:  # the leader another replica named (_watch)
                        self._follower.move_to(redirect)
                        delay = self._backoff[0]
                    # Several replicas: to the leader a standby named (at once,
                    # jittered, unless it is the address that just failed), else
                    # to the next address with the usual backoff.
                    elif self._follower.follow(exc):
                        delay = self._backoff[0]
                    delay = min(delay, self._follower.retry_cap(delay))
            except Exception:
                log.exception("coordinator link failed; reconnecting")
            finally:
                self._redirect = ""  # used above, or stale: the next stream asks anew
                self._back_pending = False  # the next welcome decides again
                if self.registered.is_set() and not self._stop.is_set():
                    self._lost = True
                    self._lost_since = time.monotonic()
                    hold = self._rebuild and self.term > 0
                    self._deliver(CoordinatorLostMsg(self._give_up_s, hold))
                self.registered.clear()
                self._call = None
                channel.close()
            if self._stop.is_set():
                break
            self._stop.wait(delay * (0.5 + random.random()))  # jitter spreads reconnects
            delay = min(delay * 2, self._follower.retry_cap(self._backoff[1]))

    def _session(self, channel: grpc.Channel) -> None:
        del self._hello.held[:]
        self._left_out = ()
        if self._snapshot is not None and not self._term_may_go_back():
            # A newer leader of this cluster adopts them (if `rebuild`); the
            # same leader tells again those that ended while the stream was
            # lost (a restarted coordinator, term 0, knows none of them).
            items = self._snapshot(SNAPSHOT_WAIT_S)
            if items is None:
                raise TimeoutError(f"no snapshot of the live transfers in {SNAPSHOT_WAIT_S} s")
            entries, left = held_entries(items)
            self._left_out = tuple(left)
            if left:
                log.warning(
                    "%d of %d live transfers left out of the hello (over %d bytes): "
                    "resolved locally at the welcome",
                    len(left),
                    len(items),
                    HELLO_HELD_BYTES,
                )
            self._hello.held.extend(entries)
        stub = pbg.AgentServiceStub(channel)
        done = threading.Event()
        self._silence.started()  # the hello's welcome is due within its limit too
        call: Any = stub.AgentStream(self._requests(done))
        self._call = call
        try:
            for msg in call:
                self._silence.heard()
                self._on_message(msg)
        except StaleLeaderError:
            call.cancel()
            raise
        finally:
            done.set()

    def _deliver_left_out(self) -> None:
        """At a welcome that keeps or adopts transfers: those the hello left out
        are unknown to it as held here, so the agent resolves them itself."""
        if self._left_out:
            self._deliver(LeftOutMsg(self._left_out))
            self._left_out = ()

    def _term_may_go_back(self) -> bool:
        """Whether an older term may be followed: only once the agent has been
        without a coordinator for give_up_s, by when it resolved every transfer
        locally and nothing of the newer term is left to protect (etcd's data
        was replaced and its revisions, so the terms, started again)."""
        return self._lost and time.monotonic() - self._lost_since >= self._give_up_s

    def _requests(self, done: threading.Event) -> Iterator[pb.AgentMessage]:
        self._hello_sent = time.monotonic()
        # A leader of an older term than this refuses us (controlplane/servicers.py).
        self._hello.term = 0 if self._term_may_go_back() else self.term
        yield pb.AgentMessage(hello=self._hello)
        now = time.monotonic()
        # Arrivals are not replayed by the coordinator: resend recent ones.
        while self._recent_arrivals and self._recent_arrivals[0][0] < now - ARRIVAL_REPLAY_S:
            self._recent_arrivals.popleft()
        for _, a in list(self._recent_arrivals):
            yield report_to_pb(a)
        seq = 0
        next_hb = now + self._hb_interval_s
        while not done.is_set() and not self._stop.is_set():
            wait = max(0.0, min(next_hb - time.monotonic(), 0.2))
            try:
                item = self.outbox.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is not None:
                if done.is_set():
                    # This stream ended while we waited (grpc still pulls from a
                    # cancelled call's iterator): the next stream sends it.
                    self.outbox.put(item)
                    break
                yield self._coalesce(item)
            now = time.monotonic()
            if now >= next_hb or self._hb_now.is_set():
                self._hb_now.clear()
                seq += 1
                self._hb_sent[seq] = now
                if len(self._hb_sent) > 64:
                    self._hb_sent.pop(min(self._hb_sent))
                yield pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq))
                next_hb = now + self._hb_interval_s

    def _coalesce(self, first: Outbound) -> pb.AgentMessage:
        """`first` and, when batching, every report already queued behind it
        (never waits for more)."""
        items = [first]
        while self._batching and len(items) < MAX_OUT_BATCH:
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:  # a wake-up: the caller checks for a heartbeat next
                items.append(item)
        now = time.monotonic()
        for item in items:
            if isinstance(item, ArrivalMsg):
                self._recent_arrivals.append((now, item))
        if len(items) == 1:
            return report_to_pb(first)
        return pb.AgentMessage(batch=pb.AgentBatch(messages=[report_to_pb(r) for r in items]))

    def _on_message(self, msg: pb.CoordinatorMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "batch":
            for item in msg.batch.messages:
                if item.WhichOneof("kind") not in ("batch", "welcome"):  # never inside one
                    self._on_message(item)
        elif kind == "welcome":
            w = msg.welcome
            previous = self.term
            if w.term != self.term:
                if w.term < self.term and not self._term_may_go_back():
                    raise StaleLeaderError(
                        f"coordinator {self._follower.current} leads term {w.term}, "
                        f"older than term {self.term} this agent follows"
                    )
                log.info("following leader term %d (was %d)", w.term, self.term)
                self.term = w.term
                # Before anything this coordinator sends: its orders are of this term.
                self._deliver(TermMsg(w.term))
            self._lease_s = w.lease_ms / 1000 or self._lease_s
            self._hb_interval_s = w.heartbeat_interval_ms / 1000 or self._hb_interval_s
            self._silence.told(w.lease_ms, w.heartbeat_interval_ms)
            lapsed = 0 < self._lease_until <= time.monotonic()  # the last welcome's lease
            self._lease_until = self._hello_sent + self._lease_s
            self.fatal_error = ""
            self.connects += 1
            if self.failed_attempts:
                log.info(
                    "welcomed by coordinator %s after %d stream%s that ended in %.1f s",
                    self._follower.current,
                    self.failed_attempts,
                    "" if self.failed_attempts == 1 else "s",
                    time.monotonic() - self._failing_since,
                )
                self.failed_attempts = 0
            if self.coordinator_id and w.coordinator_id != self.coordinator_id:
                if self._rebuild and 0 < previous < w.term:
                    log.info("leader term %d adopts this agent's transfers", w.term)
                    self._deliver(CoordinatorAdoptedMsg())  # a failover: the hello had them
                    self._deliver_left_out()
                else:
                    self._deliver(CoordinatorChangedMsg(self._lease_s))
            elif self._lost:
                if lapsed:  # before any order this welcome's lease brings
                    log.warning(
                        "welcomed back by coordinator %s after this agent's lease lapsed "
                        "(no heartbeat answered for %.1f s, the lease is %.1f s): "
                        "dropping the orders held unposted",
                        self._follower.current,
                        time.monotonic() - self._last_ack,
                        self._lease_s,
                    )
                    self._deliver(LeaseLapsedMsg())
                self._deliver_left_out()
                self._back_pending = True  # CoordinatorBackMsg at the next heartbeat ack
                self._hb_now.set()
                self.outbox.put(None)  # the request stream sends it now
            self._lost = False
            self._last_ack = max(self._last_ack, self._hello_sent)  # the welcome's lease
            self.coordinator_id = w.coordinator_id
            self._follower.reached()
            self.registered.set()
        elif kind == "heartbeat_ack":
            if self._back_pending:  # every message the welcome-back called for is in
                self._back_pending = False
                self._deliver(CoordinatorBackMsg())
            self._last_ack = time.monotonic()
            sent = self._hb_sent.pop(msg.heartbeat_ack.seq, None)
            if sent is not None:
                lease = msg.heartbeat_ack.lease_ms / 1000 or self._lease_s
                self._lease_until = max(self._lease_until, sent + lease)
        elif kind == "order":
            self._deliver(order_from_pb(msg.order))
        elif kind == "cancel_order":
            c = msg.cancel_order
            self._deliver(CancelMsg(c.order_id, c.transfer_id, c.term))
        elif kind == "peer":
            self._deliver(peer_from_pb(msg.peer))
        elif kind == "peer_fenced":
            f = msg.peer_fenced
            self._deliver(FencedMsg(f.engine_id, f.tp_rank, f.incarnation))
        elif kind == "notice":
            n = msg.notice
            self._deliver(
                NoticeMsg(
                    n.transfer_id,
                    n.state == pb.TRANSFER_STATE_COMPLETE,
                    n.write_may_land,
                    n.detail,
                )
            )


__all__ = ["CoordinatorLink", "WriteReportMsg"]
