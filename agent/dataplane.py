"""The NIXL thread: the only thread that touches the agent's NixlEndpoint.

It takes commands from its inbox queue (orders, cancels, peers, notices from
the coordinator link) and the host's bookkeeping from a deque (expectations,
holds; `from_host`), posts and polls WRITEs, reads notifications, and emits
reports (to the link) and host events.

Invariants:
- An order is posted at most once; a cancel that finds it queued drops it, so
  no WRITE is ever posted for it.
- Nothing is posted once the lease has lapsed or the order's deadline passed:
  the coordinator then treats the order as resolved. A lease that ran out
  while the stream stayed open (a starved process) holds posting instead,
  until a heartbeat is answered. An order held unposted
  when the lease lapsed is never posted, even once the same coordinator takes
  the agent back and the lease runs again (`LeaseLapsedMsg`).
- Each transfer produces at most one BLOCKS_FREE (prefill) and one of
  KV_READY / KV_FAILED (decode).
- Term fencing: an order or cancel of an older leader term than the newest the
  link has seen in a welcome is refused. A refused order is reported DROPPED
  ("refused: ...") and changes nothing here: no WRITE, no block released (the
  newer leader governs the transfer); a refused cancel is ignored.
- Failover rebuild (agent/snapshot.py): once a rebuilding agent of a leader
  term loses its coordinator, nothing more is posted until one welcomes it,
  so the snapshot its next hello carries names every order posted; a newer
  leader adopts the transfers instead of this thread resolving them.
- What it resolves itself when the coordinator is lost, replaced or takes it
  back: agent/local_resolution.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from pushkv.agent.armed import Armed, filled
from pushkv.agent.arrivals import Arrivals
from pushkv.agent.events import EventKind, HostEvent
from pushkv.agent.local_resolution import LocalResolution
from pushkv.agent.lru import Lru
from pushkv.agent.messages import (
    AbortMsg,
    ArrivalMsg,
    CancelMsg,
    CoordinatorAdoptedMsg,
    CoordinatorBackMsg,
    CoordinatorChangedMsg,
    CoordinatorLostMsg,
    ExpectMsg,
    FencedMsg,
    FireMsg,
    HoldMsg,
    Inbound,
    LeaseLapsedMsg,
    LeftOutMsg,
    NoticeMsg,
    OrderMsg,
    Outbound,
    PauseMsg,
    PeerMsg,
    ReportStatus,
    SnapshotMsg,
    TermMsg,
    WriteReportMsg,
)
from pushkv.agent.nixl_adapter import NixlEndpoint
from pushkv.agent.nixl_types import NixlError, PeerKey, WriteHandle
from pushkv.agent.notif import WriteNotif
from pushkv.agent.posting import InFlight, Poster
from pushkv.agent.progressive import Progressive, progressive_ok
from pushkv.agent.snapshot import HeldItem, SnapshotBox, decode_items, prefill_items

log = logging.getLogger("pushkv.agent")

FAST_POLL_S = 0.0005  # while WRITEs or expected arrivals are pending
IDLE_POLL_MAX_S = 0.05  # backoff ceiling when idle


_Outcome = tuple[str, ReportStatus, str]  # transfer_id, status, detail


class DataPlane(LocalResolution):
    def __init__(
        self,
        endpoint_factory: Callable[[], NixlEndpoint],
        *,
        is_prefill: bool,
        emit_report: Callable[[Outbound], None],
        emit_event: Callable[[HostEvent], None],
        lease_ok: Callable[[], bool],
        lease_renewing: Callable[[], bool] = lambda: False,
        name: str = "pushkv-nixl",
        tokens_per_block: int = 0,
    ) -> None:
        # SimpleQueue: put never waits on a lock this thread holds (C, no Condition).
        self.inbox: queue.SimpleQueue[Inbound | None] = queue.SimpleQueue()
        # The host's bookkeeping (expect, hold), appended by vLLM's engine
        # thread without a lock; drained every step. Set only while this thread
        # sleeps longer than a fast poll, and then the host wakes it.
        self._host: deque[ExpectMsg | HoldMsg] = deque()
        self._asleep = False
        self._factory = endpoint_factory
        self._prefill = is_prefill
        self._report = emit_report
        self._event = emit_event
        self._lease_ok = lease_ok
        self._lease_renewing = lease_renewing
        self._ep: NixlEndpoint | None = None
        self._posts: Poster | None = None  # the endpoint's WRITEs and peers (NIXL thread)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._metadata = b""
        self._paused = False
        # No posting between the loss of a leader and the next welcome (rebuild).
        self._frozen = False
        self.snapshots = SnapshotBox()  # published here, read by the link thread
        # prefill state
        self._queued: OrderedDict[str, OrderMsg] = OrderedDict()
        self._inflight: dict[str, InFlight] = {}
        self._finished: Lru[_Outcome] = Lru()  # order_id -> outcome
        self._freed: Lru[None] = Lru()  # transfer ids whose BLOCKS_FREE was emitted
        self._held: set[str] = set()  # transfers whose blocks the host holds for us
        self._armed = Armed(tokens_per_block)  # armed orders and early fires
        # Progressive push: armed orders with chunks posted (agent/progressive.py).
        self._partial = Progressive(tokens_per_block, self._finish, self._posted)
        self.orders_fired = 0  # armed orders filled by their fire and queued
        # decode state
        self._arrivals = Arrivals()
        # When the coordinator was lost: the moment to resolve transfers locally.
        self._give_up_at = 0.0
        self._idle = FAST_POLL_S
        # The leader term the link follows (TermMsg); 0 without --etcd.
        self._term = 0
        self.orders_refused = 0
        self.cancels_refused = 0

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 30.0) -> bytes:
        """Start the thread; returns the endpoint's NIXL metadata once ready."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"NIXL endpoint not ready within {timeout} s")
        if self._start_error is not None:
            raise self._start_error
        return self._metadata

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.inbox.put(None)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._ep = self._factory()
            self._metadata = self._ep.metadata()
            self._posts = Poster(self._ep)
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while self._step():
                pass
        except Exception:
            log.exception("NIXL thread crashed")
        finally:
            self._ep.close()

    def from_host(self, msg: ExpectMsg | HoldMsg) -> None:
        """Queue the host's bookkeeping without a lock.

        An expectation wakes this thread if it is idle, since it starts the fast
        polling of notifications. A hold is only read if the coordinator
        restarts, so it waits for the next step (at most IDLE_POLL_MAX_S).
        """
        self._host.append(msg)
        # Checked after the append: a thread going to sleep sets _asleep before
        # it looks at _host, so one of the two sees the other.
        if self._asleep and type(msg) is ExpectMsg:
            self.inbox.put(ExpectMsg(()))

    def _step(self) -> bool:
        batch: list[Inbound | None] = []
        delay = self._delay()
        if delay > FAST_POLL_S:
            self._asleep = True
            if self._host:
                delay = 0.0
        try:
            batch.append(self.inbox.get(timeout=delay))
            while True:
                batch.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        self._asleep = False
        host = self._host
        while host:
            self._handle(host.popleft())
        # The whole batch is applied before posting, so a cancel that arrived
        # with its order drops it.
        for item in batch:
            if item is None:
                return False
            self._handle(item)
        if self._give_up_at and time.monotonic() >= self._give_up_at:
            self._give_up()
        if self._partial and not (self._paused or self._frozen or self._renewing()):
            self._partial.post(self._poster(), self._guard)
        self._post_queued()
        if self._partial:
            self._partial.poll(self._poster())
        self._poll_inflight()
        if not self._prefill:
            self._read_notifs()
        return True

    @property
    def fast_polling(self) -> bool:
        """Whether this thread polls NIXL every FAST_POLL_S (WRITEs in flight,
        arrivals expected, WRITEs to post); a snapshot for tests."""
        busy = self._inflight or self._arrivals or self._partial.pending
        return bool(busy or (self._queued and not (self._paused or self._frozen)))

    def _delay(self) -> float:
        if self.fast_polling:
            self._idle = FAST_POLL_S
        else:
            self._idle = min(self._idle * 2, IDLE_POLL_MAX_S)
        return self._idle

    # ------------------------------------------------------------ commands
    def _handle(self, msg: Inbound) -> None:
        if isinstance(msg, OrderMsg):
            self._on_order(msg)
        elif isinstance(msg, CancelMsg):
            self._on_cancel(msg)
        elif isinstance(msg, PeerMsg):
            self._poster().add_peer(msg)
        elif isinstance(msg, FencedMsg):
            self._poster().fence(msg)
        elif isinstance(msg, NoticeMsg):
            self._on_notice(msg)
        elif isinstance(msg, ExpectMsg):
            now = time.monotonic()
            for tid in msg.transfer_ids:
                self._arrivals.expect(tid, now)
        elif isinstance(msg, HoldMsg):
            self._held.update(t for t in msg.transfer_ids if t not in self._freed)
        elif isinstance(msg, PauseMsg):
            self._paused = msg.paused
        elif isinstance(msg, CoordinatorChangedMsg):
            self._give_up_at, self._frozen = 0.0, False
            self._on_coordinator_changed(msg.lease_s)
        elif isinstance(msg, CoordinatorLostMsg):
            log.warning(
                "coordinator lost: transfers resolve locally in %.0f s unless it returns%s",
                msg.give_up_s,
                " or a newer leader adopts them (posting held)" if msg.hold_posts else "",
            )
            self._give_up_at = time.monotonic() + msg.give_up_s
            self._frozen = msg.hold_posts
        elif isinstance(msg, CoordinatorBackMsg):
            self._give_up_at, self._frozen = 0.0, False
        elif isinstance(msg, LeaseLapsedMsg):
            self._on_lease_lapsed()
        elif isinstance(msg, LeftOutMsg):
            self._on_left_out(msg.transfer_ids)
        elif isinstance(msg, CoordinatorAdoptedMsg):
            self._give_up_at, self._frozen = 0.0, False
            self._on_adopted()
        elif isinstance(msg, SnapshotMsg):
            self.snapshots.publish(msg.gen, self._held_items())
        elif isinstance(msg, TermMsg):
            self._term = msg.term
        elif isinstance(msg, FireMsg):
            self._on_fire(msg)
        elif isinstance(msg, AbortMsg):
            for tid in msg.transfer_ids:
                self._on_abort(tid)

    def _poster(self) -> Poster:
        assert self._posts is not None  # set before the loop starts
        return self._posts

    @property
    def writes_posted(self) -> int:
        return self._posts.writes_posted if self._posts is not None else 0

    def _refuse(self, order: OrderMsg) -> None:
        """An order of an older leader term: reported, otherwise ignored."""
        self.orders_refused += 1
        detail = f"refused: order of term {order.term}, older than term {self._term}"
        log.warning("order %s %s", order.order_id, detail)
        self._report(
            WriteReportMsg(order.order_id, order.transfer_id, ReportStatus.DROPPED, detail)
        )

    def _on_order(self, order: OrderMsg) -> None:
        if order.term < self._term:
            self._refuse(order)
            return
        oid = order.order_id
        if oid in self._queued or oid in self._inflight or self._armed.holds(oid):
            return  # replayed after a reconnect
        if self._partial.holds(oid):
            return
        done = self._finished.get(oid)
        if done is not None:
            self._report(WriteReportMsg(oid, *done))
            return
        if order.error:
            self._finish(order, ReportStatus.FAILED, order.error)
            return
        if order.transfer_id in self._freed:
            # The host may already have reused these blocks: never WRITE from them.
            self._finish(order, ReportStatus.FAILED, "blocks of this transfer were released")
            return
        if order.armed:
            fire = self._armed.arm(order)
            if fire is not None:  # the request's prompt (or a chunk) was computed first
                self._start(order, fire)
            return
        self._armed.forget_fire(order.transfer_id)
        self._queued[oid] = order

    def _on_fire(self, fire: FireMsg) -> None:
        if self._partial.fire(fire):  # a later chunk, or the final fire, of a partial order
            return
        order = self._armed.fire(fire)
        if order is not None:
            self._start(order, fire)

    def _start(self, order: OrderMsg, fire: FireMsg) -> None:
        """An armed order's first fire: the whole request, or its first chunk."""
        if fire.final:
            self._queue_fired(order, fire)
        elif progressive_ok(order):
            self.orders_fired += 1
            self._partial.start(order, fire)
        else:  # several KV groups or block sizes: written whole at the final fire
            self._armed.arm(order)

    def _queue_fired(self, order: OrderMsg, fire: FireMsg) -> None:
        """An armed order met its fire: queued with its source blocks filled."""
        ready = filled(order, fire, self._armed.tokens_per_block)
        if isinstance(ready, str):
            self._finish(order, ReportStatus.FAILED, f"armed order cannot fire: {ready}")
            return
        self.orders_fired += 1
        self._queued[order.order_id] = ready

    def _on_abort(self, tid: str) -> None:
        """The held transfer's request was aborted after it fired: nothing more
        is posted for it, and its blocks are freed once no WRITE is in flight."""
        why = "prefill request aborted"
        if self._partial.stop(tid, ReportStatus.DROPPED, f"{why} mid-prefill"):
            return  # freed once its posted chunks settled
        order = self._armed.drop(tid)
        if order is not None:
            self._finish(order, ReportStatus.DROPPED, f"{why} before its order fired")
        for oid, queued in list(self._queued.items()):
            if queued.transfer_id == tid:
                del self._queued[oid]
                self._finish(queued, ReportStatus.DROPPED, f"{why} before posting")
        if not any(f.order.transfer_id == tid for f in self._inflight.values()):
            self._free(tid, why)

    def _on_cancel(self, msg: CancelMsg) -> None:
        if msg.term < self._term:
            self.cancels_refused += 1
            log.warning(
                "cancel of order %s refused: term %d, older than term %d",
                msg.order_id,
                msg.term,
                self._term,
            )
            return
        order = self._queued.pop(msg.order_id, None) or self._armed.cancel(msg.order_id)
        if order is not None:
            self._finish(order, ReportStatus.DROPPED, "cancelled before it was posted")
            return
        if msg.order_id in self._inflight:
            return  # already posted: its outcome is reported when it completes
        if self._partial.stop_order(msg.order_id, "cancelled"):
            return  # reported once its posted chunks settled
        done = self._finished.get(msg.order_id)
        if done is not None:
            self._report(WriteReportMsg(msg.order_id, *done))
        else:
            self._report(
                WriteReportMsg(
                    msg.order_id, msg.transfer_id, ReportStatus.DROPPED, "order never received"
                )
            )
            self._finished.add(msg.order_id, (msg.transfer_id, ReportStatus.DROPPED, ""))

    def _on_notice(self, msg: NoticeMsg) -> None:
        tid = msg.transfer_id
        if self._prefill:
            armed = self._armed.drop(tid)
            if armed is not None:
                self._finish(armed, ReportStatus.DROPPED, "transfer ended before it fired")
            if self._partial.stop(tid, ReportStatus.DROPPED, "transfer ended mid-prefill"):
                return  # freed once its posted chunks settled
            for oid, order in list(self._queued.items()):
                if order.transfer_id == tid:
                    del self._queued[oid]
                    self._finish(order, ReportStatus.DROPPED, "transfer ended before posting")
            if not any(f.order.transfer_id == tid for f in self._inflight.values()):
                self._free(tid, msg.detail or ("complete" if msg.complete else "ended"))
            return
        if self._arrivals.told(tid):
            return
        if msg.complete:
            self._tell(EventKind.KV_READY, tid, msg.detail)
        elif not msg.write_may_land:
            self._tell(EventKind.KV_FAILED, tid, msg.detail)
        # else: failed but a WRITE may still land; a later notice releases it.

    def _held_items(self) -> tuple[HeldItem, ...]:
        """The live transfers (agent/snapshot.py)."""
        if not self._prefill:
            return decode_items(self._arrivals.counted(), self._arrivals.ready(time.monotonic()))
        posted = [*[f.order for f in self._inflight.values()], *self._partial.orders()]
        unposted = [*self._queued.values(), *self._armed.orders()]
        return prefill_items(self._held, posted, unposted)

    # ------------------------------------------------------------ prefill
    def _renewing(self) -> bool:
        """The lease ran out while the stream stayed open (this process
        starved the agent's threads; the coordinator keeps the agent while
        its connection answers pings): post nothing, drop nothing, until a
        heartbeat is answered (the lease runs again) or the stream ends."""
        return not self._lease_ok() and self._lease_renewing()

    def _post_queued(self) -> None:
        if self._paused or self._frozen or not self._queued or self._renewing():
            return
        while self._queued:
            _, order = self._queued.popitem(last=False)
            if order.term < self._term:  # queued before a newer leader welcomed us
                self._refuse(order)
                continue
            why = self._guard(order)
            if why:
                self._finish(order, ReportStatus.DROPPED, why)
                continue
            try:
                handles = self._poster().post(order, [(t, t.src, t.dst) for t in order.targets])
            except NixlError as exc:
                self._finish(order, ReportStatus.FAILED, str(exc))
                continue
            self._posted(order, handles)

    def _guard(self, order: OrderMsg) -> str:
        """Why nothing of `order` may be posted now (the coordinator then
        treats it as resolved), or ""."""
        if order.term < self._term:
            return f"refused: order of term {order.term}, older than term {self._term}"
        if not self._lease_ok():
            return "agent lease lapsed; not posting"
        if order.deadline_unix and time.time() > order.deadline_unix:
            return "order deadline passed before posting"
        return ""

    def _posted(
        self,
        order: OrderMsg,
        handles: list[WriteHandle],
        notify: tuple[tuple[PeerKey, bytes], ...] = (),
        replaced: int = 0,
    ) -> None:
        self._report(WriteReportMsg(order.order_id, order.transfer_id, ReportStatus.POSTED))
        self._inflight[order.order_id] = InFlight(order, handles, notify, replaced)

    def _poll_inflight(self) -> None:
        posts = self._poster()
        for oid, f in list(self._inflight.items()):
            settled = posts.outcome(f)
            if settled is None:
                continue
            del self._inflight[oid]
            failure, nbytes, descs, n = settled
            status = ReportStatus.FAILED if failure else ReportStatus.DONE
            self._finish(f.order, status, failure, nbytes, descs, n)

    def _finish(
        self,
        order: OrderMsg,
        status: ReportStatus,
        detail: str,
        nbytes: int = 0,
        descs: int = 0,
        posts: int = 0,
    ) -> None:
        self._finished.add(order.order_id, (order.transfer_id, status, detail))
        self._report(
            WriteReportMsg(order.order_id, order.transfer_id, status, detail, nbytes, descs, posts)
        )
        if not self._busy(order.transfer_id):
            self._free(order.transfer_id, f"{status.value}: {detail}" if detail else status.value)

    def _busy(self, tid: str) -> bool:
        """Whether an order of `tid` is queued or (partly) posted here."""
        return (
            tid in self._partial
            or any(o.transfer_id == tid for o in self._queued.values())
            or any(f.order.transfer_id == tid for f in self._inflight.values())
        )

    def _free(self, tid: str, detail: str) -> None:
        self._held.discard(tid)
        if tid not in self._freed:
            self._freed.add(tid)
            self._event(HostEvent(EventKind.BLOCKS_FREE, tid, detail))

    # ------------------------------------------------------------ decode
    def _read_notifs(self) -> None:
        assert self._ep is not None
        try:
            notifs = self._ep.get_notifications()
        except NixlError as exc:
            log.warning("reading notifications failed: %s", exc)
            return
        for sender, raw in notifs:
            n = WriteNotif.decode(raw)
            if n is None:
                log.warning("ignoring malformed notification from %s", sender)
                continue
            counted = self._arrivals.count(n)
            if counted is None:
                continue
            tid, rank, event = counted
            # Each writer's arrival is reported as it lands, so that status
            # names the ranks still outstanding while the others wait.
            self._report(ArrivalMsg(tid, (rank,)))
            if event is not None:
                self._event(HostEvent(event, tid, ""))
        if self._arrivals:
            for tid in self._arrivals.due(time.monotonic()):
                self._tell(EventKind.KV_FAILED, tid, "coordinator restarted mid-transfer")

    def _tell(self, kind: EventKind, tid: str, detail: str) -> None:
        self._arrivals.tell(tid, ready=kind is EventKind.KV_READY)
        self._event(HostEvent(kind, tid, detail))
