"""The rendezvous state machine: plain Python, no gRPC.

Every public method is called from one thread (the coordinator's event loop).
Methods validate, mutate, and return the effects the transport must deliver.

Invariants:
- A transfer issues orders at most once: armed, when decode registers first
  and the announced prefill engine can take them (the agents fire them at the
  request's last prefill forward), or else when the second of (decode
  registration, prefill done) arrives.
- `Transfer.write_may_land` stays True while any order is unresolved; an order
  is resolved by a DONE/FAILED/DROPPED report, or when its agent incarnation's
  lease is over (agents never post once their lease lapsed).
- The decode side is told "write_may_land=False" exactly once per terminal
  transfer, and only then may it reuse the blocks. The one exception is a
  transfer COMPLETE through its orders (reason NONE): no notice is sent, since
  every prefill rank freed its blocks on its own DONE and every decode rank
  reported KV_READY to its host before it sent the arrival that completed it.
- Every rank of an engine whose side arrives after the transfer ended gets the
  terminal notice at once, unless the transfer named that engine when it
  ended (it was told then). The side is not recorded, so a retried late
  report is told again (hosts act on a transfer's end once).

The transitions live here; the parts they use are plain Python modules too:
inflight.py (transfers held, counted, ended), agent_loss.py, admission.py,
orders.py and order_size.py (pairing, each rank's order, open orders,
arrivals), expiry.py, notices.py, adoption.py and resubmission.py (a
failover), transfer_filter.py.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import Callable, Iterable, Sequence

from pushkv.controlplane import agent_loss, validation
from pushkv.controlplane.admission import check_hello, differing_field, refused_side, side_blocks
from pushkv.controlplane.adoption import (
    WHY_WRITTEN,
    UnclaimedArrivals,
    adopt_counted,
    adopt_ready,
    issue_adopted,
    join,
    name_engines,
)
from pushkv.controlplane.clock import Clock
from pushkv.controlplane.domain import (
    MOVING,
    AgentKey,
    AgentRegistration,
    Effect,
    EngineId,
    HeldTransfer,
    OrderId,
    RankState,
    Reason,
    Role,
    State,
    TransferChanged,
    TransferId,
    WriteStatus,
)
from pushkv.controlplane.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from pushkv.controlplane.inflight import InFlight
from pushkv.controlplane.notices import transfer_notices
from pushkv.controlplane.order_size import MAX_ORDER_BYTES, OrderTooLarge
from pushkv.controlplane.orders import (
    OpenOrders,
    arm_problem,
    issue,
    mismatch,
    order_by_id,
    pair_source_blocks,
    record_arrivals,
)
from pushkv.controlplane.registry import EngineRecord, Registry
from pushkv.controlplane.resubmission import WHY_NO_AGENTS, resubmitted_side
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.transfer import Side, Transfer
from pushkv.controlplane.transfer_filter import TransferFilter
from pushkv.rules import block_groups

_RANK_OF_REPORT = {
    WriteStatus.DONE: RankState.DONE,
    WriteStatus.FAILED: RankState.FAILED,
    WriteStatus.DROPPED: RankState.DROPPED,
}
# Timeline stage names, without an Enum .value lookup (a Python property) per event.
_WRITE_STAGE = {r: f"write_{r.value}" for r in RankState}


class Rendezvous:
    def __init__(
        self, settings: CoreSettings, clock: Clock, max_order_bytes: int = MAX_ORDER_BYTES
    ) -> None:
        self.settings = settings
        self.max_order_bytes = max_order_bytes  # order_size.py
        self._clock = clock
        self.registry = Registry(settings.lease_s, settings.silent_agent_s)
        self._book = InFlight(settings, clock, self.registry)  # inflight.py
        # The book's parts, under the names the transitions use.
        self._transfers = self._book.transfers
        self._deadlines = self._book.deadlines
        self._open_orders = self._book.open_orders
        self.coordinator_id = uuid.uuid4().hex[:12]
        self._order_seq = itertools.count(1)
        # Until then (monotonic), resubmitted sides no agent re-sent are answered
        # UNAVAILABLE rather than FAILED (resubmission.py); set by lead().
        self._rebuild_until = 0.0
        # Arrivals replayed before a hello named their transfer (adoption.py).
        self._unclaimed = UnclaimedArrivals()
        # Agents whose stream closed, within their reconnect grace (agent_loss.py).
        self._away = agent_loss.Away()

    def lead(self) -> None:
        """This replica starts leading a new term: the agents' hellos (adopted
        transfers) may take up to `rebuild_window_s` to come back."""
        self._rebuild_until = self._clock.monotonic() + self.settings.rebuild_window_s

    # ================================================================ queries
    def get(self, transfer_id: str) -> Transfer:
        t = self._transfers.get(transfer_id)
        if t is None:
            raise NotFound(f"no transfer {transfer_id!r}", field="transfer_id")
        return t

    def find(self, flt: TransferFilter, limit: int) -> tuple[list[Transfer], int]:
        return flt.newest(self._transfers.values(), self._clock.wall(), limit)

    def transfers(self) -> Iterable[Transfer]:
        return self._transfers.values()

    def engines(self) -> list[EngineRecord]:
        return sorted(self.registry.engines(), key=lambda e: e.engine_id)

    def inflight_for(self, engine_id: EngineId) -> int:
        return self._book.by_engine.get(engine_id, 0)

    @property
    def inflight(self) -> int:
        return self._book.count

    @property
    def transfers_begun(self) -> int:
        return self._book.begun

    def open_orders_of(self, key: AgentKey, incarnation: str) -> int:
        return self._open_orders.count(key, incarnation)

    # ================================================================ agents
    def agent_hello(
        self, reg: AgentRegistration, held: Sequence[HeldTransfer] = (), *, adopt: bool = False
    ) -> list[Effect]:
        """`held`: the agent's live transfers, adopted on a failover (`adopt`:
        it followed an older leader; adoption.py). The same leader taking it
        back tells it again of those that ended here: a notice queued to its
        dying stream, or sent while it was away, never reached it."""
        check_hello(reg, self.settings)
        now = self._clock.monotonic()
        fenced = self.registry.hello(reg, now)
        self._away.back(reg.key)  # back within its grace: nothing fails
        effects: list[Effect] = []
        if fenced is not None:
            effects += agent_loss.fenced(self._book, fenced)
        for h in held:  # before the replay: an adopted order withdraws an undelivered one
            if adopt:
                effects += self._adopt(reg, h)
            elif (t := self._transfers.get(h.transfer_id)) is not None and t.state.terminal:
                effects += transfer_notices(self.registry, t, (reg.engine_id,))
        effects += self._open_orders.replay(reg.key, reg.incarnation, self._transfers)
        return effects

    def agent_seen(self, key: AgentKey, incarnation: str) -> bool:
        return self.registry.renew(key, incarnation, self._clock.monotonic())

    def agent_disconnected(
        self, key: AgentKey, incarnation: str, *, link_lost: bool = False
    ) -> list[Effect]:
        """The agent is `returning` for `reconnect_grace_s`: its engine stays
        ready, and if the same incarnation says hello again within it, its
        open orders are sent again (a stream that blipped loses nothing).
        Past it the engine is not ready and, with `fail_on_disconnect`, its
        moving transfers fail. `link_lost`: the stream ended with its node
        relay's, not by the agent; its transfers then wait for its lease, as
        without `fail_on_disconnect`, so a relay back within it loses
        nothing."""
        if not self.registry.disconnected(key, incarnation):
            return []
        fails = self.settings.fail_on_disconnect and not link_lost
        grace = self.settings.reconnect_grace_s
        if grace > 0:
            self.registry.require_agent(key).returning = True
            self._away.left(key, incarnation, self._clock.monotonic() + grace, fails=fails)
            return []
        if not fails:
            return []
        return agent_loss.disconnected(self._book, key, incarnation, f"agent {key} disconnected")

    def write_report(
        self,
        key: AgentKey,
        incarnation: str,
        order_id: str,
        transfer_id: str,
        status: WriteStatus,
        detail: str = "",
        nbytes: int = 0,
        descriptors: int = 0,
        posts: int = 0,
        at_unix: float = 0.0,
    ) -> list[Effect]:
        t = self._transfers.get(transfer_id)
        rec = order_by_id(t, order_id) if t else None
        if t is None or rec is None:
            return []  # unknown or forgotten order: nothing to update
        if rec.agent != key or rec.order.prefill_incarnation != incarnation:
            raise PermissionDenied(f"order {order_id} was not issued to {key}@{incarnation}")
        if rec.state.resolved:
            return []  # duplicate report
        wall = t.when(at_unix, self._clock.wall())
        effects: list[Effect] = [TransferChanged(t.transfer_id)]
        rank = rec.order.prefill_rank
        if status is WriteStatus.POSTED:
            rec.state = RankState.POSTED
            t.mark("write_posted", wall, rank)
            if t.state is State.ARMED:  # fired by the prefill engine itself
                self._deadlines.set(t, self.settings.write_timeout_s, self._clock.monotonic())
                t.state = State.WRITING
            elif t.state is State.ORDERED:
                t.state = State.WRITING
            return effects
        was_open = t.write_may_land
        rec.state = _RANK_OF_REPORT[status]
        rec.detail, rec.bytes, rec.descriptors, rec.posts = detail, nbytes, descriptors, posts
        self._open_orders.close(rec)
        t.mark(_WRITE_STAGE[rec.state], wall, rank)
        if t.state in MOVING:
            if status is WriteStatus.FAILED:
                why = f"prefill rank {rank}: {detail or 'WRITE failed'}"
                effects += self._book.finish(t, State.FAILED, Reason.WRITE_FAILED, why)
            elif status is WriteStatus.DROPPED:
                why = f"prefill rank {rank} dropped the order: {detail or 'no reason given'}"
                effects += self._book.finish(t, State.FAILED, Reason.WRITE_FAILED, why)
            else:
                effects += self._maybe_complete(t)
        elif t.state.terminal and was_open and not t.write_may_land:
            effects += self._book.released(t)
        elif t.adopting and status is not WriteStatus.DONE:  # an adopted order failed
            why = f"prefill rank {rank}: {detail or status.value} (an order of an older leader)"
            effects += self._book.finish(t, State.FAILED, Reason.WRITE_FAILED, why)
        return effects

    def arrival_report(
        self,
        key: AgentKey,
        incarnation: str,
        transfer_id: str,
        prefill_ranks: Sequence[int],
        at_unix: float = 0.0,
    ) -> list[Effect]:
        t = self._transfers.get(transfer_id)
        if t is None or t.decode_engine is None or (t.decode is None and not t.adopting):
            if (
                (t is None or t.adopting)
                and self._clock.monotonic() < self._rebuild_until
                and self.registry.is_current(key, incarnation)
            ):  # a failover's replay ahead of the hello that names the transfer
                self._unclaimed.keep(transfer_id, key, prefill_ranks)
            return []
        if key.engine_id != t.decode_engine or not self.registry.is_current(key, incarnation):
            raise PermissionDenied(f"{key}@{incarnation} is not a decode rank of {transfer_id}")
        if t.adopting:  # not ordered here yet: counted once it is
            adopt_counted(t, key.rank, tuple(prefill_ranks))
            return []
        new = record_arrivals(t, key.rank, prefill_ranks)
        if not new:
            return []
        wall = t.when(at_unix, self._clock.wall())
        for p in new:
            t.mark("arrived", wall, p)
        effects: list[Effect] = [TransferChanged(t.transfer_id)]
        if t.state in MOVING:
            effects += self._maybe_complete(t)
        return effects

    # ================================================================ requests
    def begin(
        self, transfer_id: str, prefill_engine: str, decode_engine: str
    ) -> tuple[Transfer, list[Effect]]:
        s = self.settings
        tid = validation.transfer_id(transfer_id, s.max_id_len)
        pe = EngineId(prefill_engine) if prefill_engine else None
        de = EngineId(decode_engine) if decode_engine else None
        if pe:
            validation.engine_id(pe, field="prefill_engine_id", max_len=s.max_id_len)
        if de:
            validation.engine_id(de, field="decode_engine_id", max_len=s.max_id_len)
        t = self._transfers.get(tid)
        if t is not None and t.adopting:  # the engines its agents named, if they agree
            name_engines(t, pe, de)
        if t is not None:
            if (t.announced_prefill, t.announced_decode) != (pe, de):
                raise Conflict(f"transfer {tid} was begun with other engines", field="transfer_id")
            return t, []
        t = self._book.create(tid, State.AWAITING, [e for e in (pe, de) if e])
        t.announced_prefill, t.announced_decode = pe, de
        t.mark("begun", t.created_wall)
        return t, [TransferChanged(tid)]

    def register_decode(
        self,
        transfer_id: str,
        engine: str,
        blocks: Sequence[Sequence[int]],
        num_tokens: int,
        resubmitted: bool = False,
    ) -> tuple[Transfer, list[Effect]]:
        """`resubmitted`: sent again after a failover (resubmission.py)."""
        if resubmitted and (ended := self._resubmission(transfer_id, engine)) is not None:
            return ended
        return self._arrive(Role.DECODE, transfer_id, engine, blocks, num_tokens)

    def prefill_done(
        self,
        transfer_id: str,
        engine: str,
        blocks: Sequence[Sequence[int]],
        num_tokens: int,
        finished_unix: float = 0.0,
        resubmitted: bool = False,
    ) -> tuple[Transfer, list[Effect]]:
        """`finished_unix`: when the engine finished the request, on its own clock
        (0: unknown); recorded as the timeline event "prefill_finished", read by
        nothing here. `resubmitted`: as for register_decode."""
        if resubmitted and (ended := self._resubmission(transfer_id, engine, True)) is not None:
            return ended
        return self._arrive(Role.PREFILL, transfer_id, engine, blocks, num_tokens, finished_unix)

    def cancel(self, transfer_id: str, reason: str) -> tuple[Transfer, list[Effect]]:
        s = self.settings
        tid = validation.transfer_id(transfer_id, s.max_id_len)
        if len(reason) > 1024:
            raise InvalidArgument("longer than 1024 characters", field="reason")
        t = self._transfers.get(tid)
        detail = reason or "cancelled"
        if t is None:
            # A tombstone: a side that arrives later learns at once that it is cancelled.
            t = self._book.create(tid, State.AWAITING, [])
            t.mark("begun", t.created_wall)
        if t.state.terminal:
            return t, []
        return t, self._book.finish(t, State.CANCELLED, Reason.CANCELLED, detail)

    def side_refused(self, transfer_id: str, role: Role, engine: str, why: str) -> list[Effect]:
        """A side refused for good (NoAgents): admission.refused_side."""
        return refused_side(self._book, transfer_id, role, engine, why)

    # ================================================================ time
    def tick(self) -> list[Effect]:
        now = self._clock.monotonic()
        effects: list[Effect] = []
        lost, gone = self.registry.expire(now)
        for rec in lost:
            effects += agent_loss.lost(self._book, rec)
        for key, inc, fails in self._away.due(now):
            grace_s = self.settings.reconnect_grace_s
            effects += agent_loss.grace_over(self._book, key, inc, fails, grace_s)
        for key, inc in gone:
            effects += agent_loss.resolve_orders(
                self._book, key, inc, "replaced incarnation's lease over"
            )
        for t in self._deadlines.due(now, self._transfers):
            effects += self._book.finish(
                t, State.EXPIRED, Reason.DEADLINE, f"deadline passed in state {t.state.value}"
            )
        self._book.retention.sweep(self._transfers, now)
        if self._unclaimed and now >= self._rebuild_until:
            self._unclaimed.clear()
        return effects

    def next_wakeup(self) -> float | None:
        """Monotonic time of the next deadline or lease expiry, if any."""
        due = (
            self._deadlines.earliest(self._transfers),
            self.registry.next_deadline(),
            self._away.earliest(),
        )
        return min((d for d in due if d is not None), default=None)

    # ================================================================ internals
    def _arrive(
        self,
        role: Role,
        transfer_id: str,
        engine: str,
        blocks: Sequence[Sequence[int]],
        num_tokens: int,
        finished_unix: float = 0.0,
    ) -> tuple[Transfer, list[Effect]]:
        s = self.settings
        field = "decode_engine_id" if role is Role.DECODE else "prefill_engine_id"
        t = self._transfers.get(transfer_id)
        # Ids already held (a known transfer, a registered engine) were validated then.
        tid = t.transfer_id if t is not None else validation.transfer_id(transfer_id, s.max_id_len)
        eng = self.registry.engine(engine)
        if eng is None or eng.role is not role:
            eid = validation.engine_id(engine, field=field, max_len=s.max_id_len)
            if eng is None and self._clock.monotonic() < self._rebuild_until:
                raise Unavailable(WHY_NO_AGENTS.format(engine=eid), field=field)
            eng = self.registry.require_engine(eid, role, field_name=field)
        eid = eng.engine_id
        side = Side(eid, side_blocks(role, eng, blocks, num_tokens, s), num_tokens)
        now, wall = self._clock.monotonic(), self._clock.wall()
        created = t is None
        if t is None:
            t = self._book.create(tid, State.AWAITING, [eid], now, wall)
        else:
            announced = t.announced_decode if role is Role.DECODE else t.announced_prefill
            if announced and announced != eid:
                raise Conflict(f"transfer {tid} was begun with {field} {announced}", field=field)
        current = t.decode if role is Role.DECODE else t.prefill
        if current is not None:
            if current != side:
                raise Conflict(
                    f"transfer {tid} already has a different {role.value} report",
                    field=differing_field(current, side, field),
                )
            return t, []  # an idempotent retry
        if t.state.terminal:
            # Cancelled or expired before this side arrived: the answer says so,
            # and an engine the transfer did not name when it ended (so was not
            # told then) gets the terminal notice now, on every rank.
            if eid in (t.prefill_engine, t.decode_engine):
                if finished_unix > 0 and t.orders:  # an armed order finished first
                    t.mark("prefill_finished", finished_unix)  # (the critical path's)
                return t, []
            return t, transfer_notices(self.registry, t, (eid,))
        self._book.count_engine(t, eid)
        effects: list[Effect] = [TransferChanged(tid)]
        if role is Role.DECODE:
            t.decode = side
            t.mark("decode_registered", wall)
        else:
            t.prefill = side
            if finished_unix > 0:
                t.mark("prefill_finished", finished_unix)
            t.mark("prefill_done", wall)
        if t.orders and not t.adopting:  # armed at decode's registration: prefill is done now
            effects += self._prefill_after_arming(t, now)
        elif t.decode is not None and t.prefill is not None:
            effects += self._issue_orders(t)
        elif t.decode is not None and s.arm_orders and self._arm_orders(t, effects):
            pass
        else:
            t.state = State.REGISTERED if role is Role.DECODE else State.PREFILL_DONE
            if not created:  # create() set this very deadline
                self._deadlines.set(t, s.rendezvous_timeout_s, now)
        return t, effects

    def _issue_orders(self, t: Transfer) -> list[Effect]:
        assert t.decode is not None and t.prefill is not None
        pe = self.registry.engine(t.prefill.engine_id)
        de = self.registry.engine(t.decode.engine_id)
        if pe is None or de is None or not pe.ready or not de.ready:
            missing = t.prefill.engine_id if pe is None or not pe.ready else t.decode.engine_id
            return self._book.finish(
                t, State.FAILED, Reason.AGENT_LOST, f"engine {missing} not ready"
            )
        problem = mismatch(t, pe, de)
        if problem:
            return self._book.finish(t, State.FAILED, Reason.MISMATCH, problem)
        if not any(t.decode.blocks):  # every group empty
            return self._book.finish(
                t, State.COMPLETE, Reason.NOTHING_TO_WRITE, "decode side had every block cached"
            )
        src = pair_source_blocks(t.prefill, t.decode, pe.tokens_per_block, de.tokens_per_block)
        s = self.settings
        wall = self._clock.wall()
        until = wall + s.write_timeout_s
        if not t.adopting:
            try:
                effects = issue(t, pe, de, src, until, False, *self._order_args())
            except OrderTooLarge as exc:
                return self._book.finish(t, State.FAILED, Reason.TOO_LARGE, str(exc))
            self._deadlines.set(t, s.write_timeout_s, self._clock.monotonic())
            t.mark("ordered", wall)
            t.state = State.ORDERED
            return effects
        self._deadlines.set(t, s.write_timeout_s, self._clock.monotonic())
        t.mark("ordered", wall)
        self._unclaimed.claim(t)
        effects = issue_adopted(t, pe, de, src, until, self._order_id, self._open_orders)
        posted = any(o.adopted for o in t.orders.values())  # before the failover
        t.state = State.WRITING if posted else State.ORDERED
        return effects + self._maybe_complete(t)  # adopted ranks may be done already

    def _order_id(self) -> OrderId:
        """Unique per coordinator process."""
        return OrderId(f"{self.coordinator_id}-{next(self._order_seq)}")

    def _order_args(self) -> tuple[Callable[[], OrderId], OpenOrders, int]:
        return self._order_id, self._open_orders, self.max_order_bytes

    def _arm_orders(self, t: Transfer, effects: list[Effect]) -> bool:
        """Decode registered first: arm the orders on the announced prefill
        engine's agents (appended to `effects`), if it can take them; False
        leaves the transfer to wait for prefill done as before."""
        assert t.decode is not None
        if t.announced_prefill is None or t.adopting:  # adopted: prefill may be done
            return False
        pe = self.registry.engine(t.announced_prefill)
        de = self.registry.engine(t.decode.engine_id)
        if pe is None or de is None or not pe.ready or not de.ready:
            return False
        if arm_problem(t, pe, de):
            return False
        # Posted no later than the moment this transfer stops waiting for prefill.
        now, wall = self._clock.monotonic(), self._clock.wall()
        wait_s = self.settings.rendezvous_timeout_s
        empty = block_groups.none(len(t.decode.blocks))
        try:  # too large: prefill done will fail it (its orders are larger still)
            effects += issue(t, pe, de, empty, wall + wait_s, True, *self._order_args())
        except OrderTooLarge:
            return False
        self._deadlines.set(t, wait_s, now)
        t.state = State.ARMED
        t.mark("armed", wall)
        return True

    def _prefill_after_arming(self, t: Transfer, now: float) -> list[Effect]:
        """Prefill done on a transfer whose orders are armed (or already fired):
        the prefill agents filled the blocks themselves, so the report is
        checked against decode's side, and the WRITE's time starts now."""
        pe = self.registry.engine(t.prefill_engine) if t.prefill_engine else None
        de = self.registry.engine(t.decode_engine) if t.decode_engine else None
        if pe is None or de is None:
            return self._book.finish(t, State.FAILED, Reason.AGENT_LOST, "engine not registered")
        problem = mismatch(t, pe, de)
        if problem:
            return self._book.finish(t, State.FAILED, Reason.MISMATCH, problem)
        if t.state is State.ARMED:
            t.state = State.ORDERED
            self._deadlines.set(t, self.settings.write_timeout_s, now)
        return self._maybe_complete(t)

    def _maybe_complete(self, t: Transfer) -> list[Effect]:
        for o in t.orders.values():
            if o.state is not RankState.DONE:
                return []
        if t.all_arrived():
            return self._book.finish(t, State.COMPLETE, Reason.NONE, "")
        return []

    def _resubmission(
        self, transfer_id: str, engine: str, prefill: bool = False
    ) -> tuple[Transfer, list[Effect]] | None:
        """A resubmitted side: resubmission.resubmitted_side."""
        now = self._clock.monotonic()
        return resubmitted_side(self._book, transfer_id, engine, prefill, now, self._rebuild_until)

    def _adopt(self, reg: AgentRegistration, h: HeldTransfer) -> list[Effect]:
        """One transfer an agent re-sent in its hello (adoption.py)."""
        t = self._transfers.get(h.transfer_id)
        if t is None and validation.valid_transfer_id(h.transfer_id, self.settings.max_id_len):
            # Counted at the old leader: no in-flight limit refuses it here.
            t = self._book.create(TransferId(h.transfer_id), State.AWAITING, [], limits=False)
            t.adopting = True
        if t is None or t.state.terminal:  # ended here: this engine may not have been told
            return transfer_notices(self.registry, t, (reg.engine_id,)) if t else []
        wall = self._clock.wall()
        if not join(t, reg, h, wall + self.settings.write_timeout_s, self._open_orders):
            return []  # the transfer is another engine's: not this agent's to adopt
        if reg.engine_id not in t.counted:  # the engine's first hello that names it
            self._book.count_engine(t, reg.engine_id, limit=False)
            t.mark("adopted", wall, reg.key.rank)
        if h.ready and t.adopting and reg.role is Role.DECODE:
            eng = self.registry.engine(reg.engine_id)
            if eng is not None and adopt_ready(t, reg.key.rank, eng.size):
                t.mark("written_before_failover", wall)
                return self._book.finish(t, State.COMPLETE, Reason.NONE, WHY_WRITTEN)
        if h.counted and not t.adopting:  # ordered here already: these are arrivals
            with contextlib.suppress(InvalidArgument, PermissionDenied):
                return self.arrival_report(reg.key, reg.incarnation, t.transfer_id, h.counted)
        return [TransferChanged(t.transfer_id)]

    def has_transfer(self, transfer_id: str) -> bool:
        return transfer_id in self._transfers

    def transfer(self, transfer_id: str) -> Transfer | None:
        """The transfer, or None if unknown or forgotten."""
        return self._transfers.get(transfer_id)
