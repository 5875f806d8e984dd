"""Coordinator runtime: owns the core, the agent sessions and the watchers.

Everything here runs on the server's event loop, so the core needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import structlog

from pushkv.controlplane import convert, logs
from pushkv.controlplane.clock import Clock
from pushkv.controlplane.domain import (
    AgentKey,
    AgentNotBack,
    AgentRegistration,
    Effect,
    HeldTransfer,
    Order,
    SendCancelOrder,
    SendNotice,
    SendOrder,
    SendPeerFenced,
    TransferChanged,
)
from pushkv.controlplane.errors import InvalidArgument
from pushkv.controlplane.order_size import MAX_ORDER_BYTES
from pushkv.controlplane.peer_messages import PeerMessages
from pushkv.controlplane.rendezvous import Rendezvous
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.timeline import TransferObserver
from pushkv.controlplane.transfer import Transfer
from pushkv.controlplane.transfer_filter import TransferFilter
from pushkv.v1 import pushkv_pb2 as pb

# The tick loop sleeps until the next deadline, within these bounds.
TICK_MIN_S, TICK_MAX_S = 0.005, 0.25

log = structlog.get_logger("pushkv.coordinator")

OUTBOX_LIMIT = 100_000
# At most this many queued messages go out as one CoordinatorMessage.batch.
MAX_OUT_BATCH = 256
WATCH_QUEUE_LIMIT = 10_000

# An outbox holds orders as domain values: each is filled straight into the
# message that carries it (a protobuf sub-message added to a batch is copied).
Outgoing: TypeAlias = pb.CoordinatorMessage | Order


def to_message(item: Outgoing, term: int = 0) -> pb.CoordinatorMessage:
    """An outbox item as the message that carries it alone (an order stamped
    with the leader's `term`)."""
    if isinstance(item, pb.CoordinatorMessage):
        return item
    msg = convert.order_message(item)
    if term:
        msg.order.term = term
    return msg


def _add(msgs: Any, item: Outgoing, term: int) -> None:
    """Append `item` to a CoordinatorBatch's messages (an order is filled in place)."""
    if isinstance(item, pb.CoordinatorMessage):
        msgs.append(item)
    else:
        m = msgs.add().order
        convert.fill_order(m, item)
        if term:
            m.term = term


@dataclass(eq=False)
class AgentSession:
    reg: AgentRegistration
    outbox: asyncio.Queue[Outgoing | None] = field(
        default_factory=lambda: asyncio.Queue(OUTBOX_LIMIT)
    )
    known_peers: set[tuple[AgentKey, str]] = field(default_factory=set)
    closed: bool = False
    accepts_batches: bool = False  # AgentHello.accepts_batches
    via: str = ""  # the node relay carrying this session ("": its own AgentStream)
    # Ended with its relay's stream, not by the agent: the agent is not known
    # to be gone, so its transfers wait for its lease (it may come back).
    link_lost: bool = False
    # The leader's term, stamped on every order (0: no --etcd).
    term: int = 0
    # Called after every message queued, the end included: a NodeStream
    # channel moves its outbox then, with no task of its own (node_stream.py).
    # None: a stream's response task waits on the outbox instead.
    notify: Callable[[], None] | None = None
    # Told each order's residence (seconds from its queueing here, in the
    # core step that issued it, to its message handed to gRPC), if set (the
    # coordinator's metrics). `stamps` holds the queueing times of the
    # orders in the outbox, oldest first: one per Order item.
    residence: Callable[[float], None] | None = None
    stamps: deque[float] = field(default_factory=deque)
    # Set for a NodeStream channel: the taken orders' stamps go here, and the
    # stream tells `residence` once it hands their message to gRPC (a queue
    # hop later, node_stream.py). None: told at once (an AgentStream yields
    # what it takes).
    handoff: list[float] | None = None

    def take(self, first: Outgoing) -> tuple[pb.CoordinatorMessage, bool]:
        """What to send now, given the item just taken from the outbox, and
        whether the session ended. With a batching agent, everything already
        queued behind `first` goes out with it (never waits for more)."""
        q = self.outbox
        term = self.term
        k = int(type(first) is not pb.CoordinatorMessage)  # orders taken
        if not self.accepts_batches or q.empty():
            self._taken(k)
            return to_message(first, term), False
        nxt = q.get_nowait()
        if nxt is None:
            self._taken(k)
            return to_message(first, term), True
        out = pb.CoordinatorMessage()
        msgs = out.batch.messages
        _add(msgs, first, term)
        _add(msgs, nxt, term)
        n = 2
        k += type(nxt) is not pb.CoordinatorMessage
        ended = False
        while n < MAX_OUT_BATCH and not q.empty():
            item = q.get_nowait()
            if item is None:
                ended = True
                break
            _add(msgs, item, term)
            k += type(item) is not pb.CoordinatorMessage
            n += 1
        self._taken(k)
        return out, ended

    def _taken(self, k: int) -> None:
        """`k` orders left the outbox: their residences, to `residence` (or
        their stamps to `handoff`). Nothing without metrics (no stamps)."""
        stamps, told, held = self.stamps, self.residence, self.handoff
        n = min(k, len(stamps))
        if not n:
            return
        if held is not None:
            held.extend(stamps.popleft() for _ in range(n))
            return
        now = time.monotonic()
        for _ in range(n):
            at = stamps.popleft()
            if told is not None:
                told(now - at)

    @property
    def key(self) -> AgentKey:
        return self.reg.key

    def send(self, msg: Outgoing) -> None:
        if self.closed:
            return
        try:
            self.outbox.put_nowait(msg)
        except asyncio.QueueFull:
            log.error("agent_outbox_full", agent=str(self.key))
            self.close()
            return
        if self.residence is not None and type(msg) is not pb.CoordinatorMessage:
            self.stamps.append(time.monotonic())
        if self.notify is not None:
            self.notify()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(asyncio.QueueFull):
                self.outbox.put_nowait(None)
            if self.notify is not None:
                self.notify()


@dataclass(eq=False)
class Watcher:
    flt: TransferFilter
    queue: asyncio.Queue[pb.TransferEvent | None] = field(
        default_factory=lambda: asyncio.Queue(WATCH_QUEUE_LIMIT)
    )
    overflowed: bool = False


class Runtime:
    def __init__(
        self, settings: CoreSettings, clock: Clock, max_order_bytes: int = MAX_ORDER_BYTES
    ) -> None:
        self.core = Rendezvous(settings, clock, max_order_bytes)
        self.clock = clock
        self._sessions: dict[AgentKey, AgentSession] = {}
        self._peer_msgs = PeerMessages(self.core.registry)
        self._watchers: set[Watcher] = set()
        self._ticker: asyncio.Task[None] | None = None
        # Metrics and tracing (controlplane/metrics.py, tracing.py), told of every change.
        self.observers: list[TransferObserver] = []
        # While an agent's batch applies: the transfers it changed, told once
        # each at the batch's end (the observers read every new timeline event
        # then, so nothing is lost; a watcher sees the batch's last state).
        self._batch_changed: dict[str, None] | None = None
        # Given to every session opened from now on (AgentSession.residence).
        self.order_residence: Callable[[float], None] | None = None
        # The leader's term (controlplane/leadership.py): set once, when this
        # replica is elected (a replica that loses the leadership ends), and
        # stamped on every welcome, order and cancel. 0 without --etcd.
        self.term = 0

    # ---------------------------------------------------------------- lifecycle
    def lead(self, term: int) -> None:
        """This replica was elected for `term`: stamped on everything sent from
        now on, and the core's rebuild window for resubmissions opens."""
        if term != self.term:
            self.term = term
            self.core.lead()

    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop(), name="ticker")

    async def stop(self) -> None:
        if self._ticker:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for s in list(self._sessions.values()):
            s.close()
        for w in list(self._watchers):
            with contextlib.suppress(asyncio.QueueFull):
                w.queue.put_nowait(None)

    def silence(self) -> None:
        """Send nothing more to any agent, at once: queued messages are dropped,
        every agent stream ends and the clock stops ticking. For a replica that
        lost the leadership (controlplane/election.py); the process ends next."""
        if self._ticker:
            self._ticker.cancel()
        for s in list(self._sessions.values()):
            while not s.outbox.empty():
                s.outbox.get_nowait()
            s.stamps.clear()
            s.close()

    async def _tick_loop(self) -> None:
        while True:
            try:
                self.apply(self.core.tick())
            except Exception:
                log.exception("tick_failed")
            nxt = self.core.next_wakeup()
            soon = TICK_MAX_S if nxt is None else nxt - self.clock.monotonic()
            delay = min(max(soon, TICK_MIN_S), TICK_MAX_S)
            await asyncio.sleep(delay)

    # ---------------------------------------------------------------- effects
    def apply(self, effects: Sequence[Effect]) -> None:
        deferred = self._batch_changed
        if len(effects) == 1 and type(effects[0]) is TransferChanged:
            # Most reports change one transfer only.
            if deferred is not None:
                deferred[effects[0].transfer_id] = None
            else:
                self._changed(effects[0].transfer_id)
            return
        changed: dict[str, None] = {} if deferred is None else deferred
        for e in effects:
            if isinstance(e, TransferChanged):
                changed[e.transfer_id] = None
            elif isinstance(e, SendOrder):
                s = self._session(e.to, e.incarnation)
                if s is None:
                    continue  # replayed when the agent reconnects
                for tgt in e.order.targets:
                    self._ensure_peer(s, tgt.decode_engine_id, tgt.decode_rank)
                s.send(e.order)
                if logs.debug_enabled():
                    log.debug("order_sent", transfer_id=e.order.transfer_id, agent=str(e.to))
            elif isinstance(e, SendCancelOrder):
                s = self._session(e.to, e.incarnation)
                if s is not None:
                    s.send(
                        pb.CoordinatorMessage(
                            cancel_order=pb.CancelOrder(
                                order_id=e.order_id,
                                transfer_id=e.transfer_id,
                                reason=convert.REASON_TO_PB[e.reason],
                                term=self.term,
                            )
                        )
                    )
            elif isinstance(e, SendNotice):
                s = self._session(e.to, e.incarnation)
                if s is not None:
                    s.send(pb.CoordinatorMessage(notice=convert.notice_to_pb(e.notice)))
            elif isinstance(e, AgentNotBack):
                # A loss that failed transfers is a warning: an operator running
                # at WARNING sees which agent's stream ended and what it cost.
                (log.warning if e.transfers_failed else log.info)(
                    "agent_not_back",
                    engine_id=e.key.engine_id,
                    rank=e.key.rank,
                    incarnation=e.incarnation,
                    transfers_failed=e.transfers_failed,
                    reconnect_grace_s=self.core.settings.reconnect_grace_s,
                )
            elif isinstance(e, SendPeerFenced):
                s = self._session(e.to, e.incarnation)
                peer = (e.peer, e.peer_incarnation)
                if s is not None and peer in s.known_peers:
                    s.known_peers.discard(peer)
                    s.send(
                        pb.CoordinatorMessage(
                            peer_fenced=pb.PeerFenced(
                                engine_id=e.peer.engine_id,
                                tp_rank=e.peer.rank,
                                incarnation=e.peer_incarnation,
                            )
                        )
                    )
        if deferred is None:
            for tid in changed:
                self._changed(tid)

    def _changed(self, transfer_id: str) -> None:
        """Tell the observers and the watchers about a changed transfer."""
        if not (self.observers or self._watchers):
            return
        t = self.core.transfer(transfer_id)
        if t is None:
            return
        for obs in self.observers:
            try:
                obs.on_transfer_changed(t)
            except Exception:  # observability must never break the rendezvous
                log.exception("observer_failed", observer=type(obs).__name__)
        if self._watchers:
            self._publish(t)

    def _session(self, key: AgentKey, incarnation: str) -> AgentSession | None:
        s = self._sessions.get(key)
        if s is None or s.closed or s.reg.incarnation != incarnation:
            return None
        return s

    def _ensure_peer(self, s: AgentSession, engine_id: str, rank: int) -> None:
        eng = self.core.registry.engine(engine_id)
        rec = eng.ranks.get(rank) if eng is not None else None
        if rec is None:
            return
        peer = (rec.key, rec.incarnation)
        if peer in s.known_peers:
            return
        s.known_peers.add(peer)
        s.send(self._peer_msgs.get(rec))

    # ---------------------------------------------------------------- agents
    def open_session(
        self,
        reg: AgentRegistration,
        *,
        accepts_batches: bool = False,
        held: Sequence[HeldTransfer] = (),
        adopt: bool = False,
        via: str = "",
    ) -> AgentSession:
        effects = self.core.agent_hello(reg, held, adopt=adopt)
        old = self._sessions.get(reg.key)
        if old is not None:
            old.close()
        s = AgentSession(
            reg,
            accepts_batches=accepts_batches,
            term=self.term,
            via=via,
            residence=self.order_residence,
        )
        self._sessions[reg.key] = s
        st = self.core.settings
        s.send(
            pb.CoordinatorMessage(
                welcome=pb.Welcome(
                    lease_ms=int(st.lease_s * 1000),
                    heartbeat_interval_ms=int(st.heartbeat_interval_s * 1000),
                    coordinator_id=self.core.coordinator_id,
                    term=self.term,
                )
            )
        )
        self.apply(effects)
        log.info(
            "agent_registered",
            engine_id=reg.engine_id,
            rank=reg.key.rank,
            role=reg.role.value,
            incarnation=reg.incarnation,
            tp_size=reg.tp_size,
            pp_size=reg.pp_size,
            kv_heads=reg.layout.kv_heads,
            head_major=reg.layout.head_major,
            block_len=reg.layout.regions[0].block_len,
            regions=len(reg.layout.regions),
            compat=dict(reg.layout.compat),
            api_url=reg.api_url,
            on_transfer_failure=reg.on_transfer_failure.value,
        )
        return s

    def close_session(self, s: AgentSession) -> None:
        s.close()
        if self._sessions.get(s.key) is s:
            del self._sessions[s.key]
            effects = self.core.agent_disconnected(s.key, s.reg.incarnation, link_lost=s.link_lost)
            self.apply(effects)  # with a reconnect grace, none yet (agent_not_back)
            log.info(
                "agent_disconnected",
                engine_id=s.key.engine_id,
                rank=s.key.rank,
                **({"relay_lost": s.via} if s.link_lost else {}),
            )

    def on_agent_message(self, s: AgentSession, msg: pb.AgentMessage) -> None:
        """One message from an agent's stream. A bad report raises (the caller
        logs it); inside a batch, a bad item is logged and the rest still apply."""
        if not self.core.agent_seen(s.key, s.reg.incarnation):
            s.close()  # fenced or lost: the agent must reconnect and register again
            return
        kind = msg.WhichOneof("kind")
        if kind != "batch":
            self._on_item(s, msg, kind)
            return
        changed: dict[str, None] = {}
        self._batch_changed = changed
        try:
            for item in msg.batch.messages:
                try:
                    kind = item.WhichOneof("kind")
                    if kind in {"batch", "hello"}:
                        raise InvalidArgument("a batch holds no hello and no nested batch")
                    self._on_item(s, item, kind)
                except Exception as exc:
                    log.warning("agent_message_rejected", agent=str(s.key), error=str(exc))
        finally:
            self._batch_changed = None
            for tid in changed:
                self._changed(tid)

    def _on_item(self, s: AgentSession, msg: pb.AgentMessage, kind: str | None) -> None:
        key, inc = s.reg.key, s.reg.incarnation
        if kind == "heartbeat":
            s.send(
                pb.CoordinatorMessage(
                    heartbeat_ack=pb.HeartbeatAck(
                        seq=msg.heartbeat.seq,
                        lease_ms=int(self.core.settings.lease_s * 1000),
                    )
                )
            )
        elif kind == "write":
            w = msg.write
            status = convert.WRITE_FROM_PB.get(w.status)
            if status is None:
                log.warning("bad_write_report", agent=str(key), status=w.status)
                return
            self.apply(
                self.core.write_report(
                    key,
                    inc,
                    w.order_id,
                    w.transfer_id,
                    status,
                    w.detail,
                    w.bytes,
                    w.descriptors,
                    w.posts,
                    w.at_unix_us / 1e6,
                )
            )
        elif kind == "arrival":
            a = msg.arrival
            self.apply(
                self.core.arrival_report(
                    key, inc, a.transfer_id, list(a.prefill_ranks), a.at_unix_us / 1e6
                )
            )
        elif kind == "hello":
            log.warning("duplicate_hello", agent=str(key))

    # ---------------------------------------------------------------- status
    def status(self, t: Transfer) -> pb.TransferStatus:
        offset = self.clock.wall() - self.clock.monotonic()
        return convert.transfer_to_pb(t, deadline_wall=t.deadline_mono + offset)

    def engines(self, role: int) -> list[pb.EngineStatus]:
        offset = self.clock.wall() - self.clock.monotonic()
        out = []
        for eng in self.core.engines():
            if role and convert.ROLE_TO_PB[eng.role] != role:
                continue
            open_orders = {
                r: self.core.open_orders_of(a.key, a.incarnation) for r, a in eng.ranks.items()
            }
            out.append(
                convert.engine_to_pb(
                    eng,
                    inflight=self.core.inflight_for(eng.engine_id),
                    open_orders=open_orders,
                    wall_offset=offset,
                    relays=self._relays(eng.ranks.values()),
                )
            )
        return out

    def _relays(self, recs: Any) -> dict[int, str]:
        """rank -> the relay carrying its live session (ranks with one only)."""
        out: dict[int, str] = {}
        for a in recs:
            s = self._sessions.get(a.key)
            if s is not None and s.via and s.reg.incarnation == a.incarnation:
                out[a.key.rank] = s.via
        return out

    def watch(self, flt: TransferFilter) -> Watcher:
        w = Watcher(flt)
        self._watchers.add(w)
        return w

    def unwatch(self, w: Watcher) -> None:
        self._watchers.discard(w)

    def _publish(self, t: Transfer) -> None:
        now = self.clock.wall()
        event: pb.TransferEvent | None = None
        for w in list(self._watchers):
            if w.overflowed or not w.flt.matches(t, now):
                continue
            if event is None:
                event = pb.TransferEvent(transfer=self.status(t))
            try:
                w.queue.put_nowait(event)
            except asyncio.QueueFull:
                # A watcher that cannot keep up is closed, never allowed to grow memory.
                w.overflowed = True
                self._watchers.discard(w)
                while not w.queue.empty():
                    w.queue.get_nowait()
                w.queue.put_nowait(None)
