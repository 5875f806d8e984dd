"""The rendezvous state machine: plain Python, no gRPC.

Every public method is called from one thread (the coordinator's event loop).
Methods validate, mutate, and return the effects the transport must deliver.

Invariants:
- A transfer issues orders at most once, when the second of (decode
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
"""

from __future__ import annotations

import heapq
import itertools
import math
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from controlplane import validation
from controlplane.clock import Clock
from controlplane.domain import (
    AgentKey,
    AgentRegistration,
    Blocks,
    Effect,
    EngineId,
    Notice,
    Order,
    OrderId,
    RankState,
    Reason,
    Role,
    SendCancelOrder,
    SendNotice,
    SendOrder,
    SendPeerFenced,
    State,
    TransferChanged,
    TransferId,
    WriteStatus,
    WriteTarget,
)
from controlplane.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from controlplane.registry import AgentRecord, EngineRecord, Registry
from controlplane.settings import CoreSettings
from controlplane.transfer import OrderRecord, Side, Transfer

_WAITING = (State.AWAITING, State.REGISTERED, State.PREFILL_DONE)
_MOVING = (State.ORDERED, State.WRITING)
_RANK_OF_REPORT = {
    WriteStatus.DONE: RankState.DONE,
    WriteStatus.FAILED: RankState.FAILED,
    WriteStatus.DROPPED: RankState.DROPPED,
}
# Timeline stage names, without an Enum .value lookup (a Python property) per event.
_WRITE_STAGE = {r: f"write_{r.value}" for r in RankState}
_STAGE = {st: st.value for st in State}


@dataclass(frozen=True, slots=True)
class TransferFilter:
    states: frozenset[State] = frozenset()
    engine_id: str = ""
    min_age_s: float = 0.0
    max_age_s: float = 0.0

    def matches(self, t: Transfer, now_wall: float) -> bool:
        if self.states and t.state not in self.states:
            return False
        if self.engine_id and self.engine_id not in (t.prefill_engine, t.decode_engine):
            return False
        age = now_wall - t.created_wall
        if age < self.min_age_s:
            return False
        return not (self.max_age_s and age > self.max_age_s)


class Rendezvous:
    def __init__(self, settings: CoreSettings, clock: Clock) -> None:
        self.settings = settings
        self._clock = clock
        self.registry = Registry(settings.lease_s)
        # Keyed by plain str: lookups need no TransferId() call (ids in it were validated).
        self._transfers: dict[str, Transfer] = {}
        self._inflight = 0
        self._inflight_by_engine: dict[EngineId, int] = {}
        self._deadlines: list[tuple[float, int, TransferId]] = []
        self._terminal: deque[TransferId] = deque()
        # Unresolved orders per agent incarnation: (key, incarnation) -> {(transfer, rank)}
        self._open_orders: dict[tuple[AgentKey, str], set[tuple[TransferId, int]]] = {}
        self._order_seq = itertools.count(1)
        self.coordinator_id = uuid.uuid4().hex[:12]

    # ================================================================ queries
    def get(self, transfer_id: str) -> Transfer:
        t = self._transfers.get(transfer_id)
        if t is None:
            raise NotFound(f"no transfer {transfer_id!r}", field="transfer_id")
        return t

    def find(self, flt: TransferFilter, limit: int) -> tuple[list[Transfer], int]:
        now = self._clock.wall()
        matching = [t for t in self._transfers.values() if flt.matches(t, now)]
        matching.sort(key=lambda t: t.created_wall, reverse=True)
        return matching[:limit], len(matching)

    def transfers(self) -> Iterable[Transfer]:
        return self._transfers.values()

    def engines(self) -> list[EngineRecord]:
        return sorted(self.registry.engines(), key=lambda e: e.engine_id)

    def inflight_for(self, engine_id: EngineId) -> int:
        return self._inflight_by_engine.get(engine_id, 0)

    @property
    def inflight(self) -> int:
        return self._inflight

    def open_orders_of(self, key: AgentKey, incarnation: str) -> int:
        return len(self._open_orders.get((key, incarnation), ()))

    # ================================================================ agents
    def agent_hello(self, reg: AgentRegistration) -> list[Effect]:
        s = self.settings
        validation.engine_id(reg.engine_id, field="identity.engine_id", max_len=s.max_id_len)
        validation.check_id(reg.incarnation, field="identity.incarnation", max_len=s.max_id_len)
        if not reg.nixl_agent_name:
            raise InvalidArgument("must not be empty", field="nixl_agent_name")
        if len(reg.nixl_agent_name) > s.max_id_len or len(reg.api_url) > 2048:
            raise InvalidArgument("too long", field="nixl_agent_name/api_url")
        if reg.layout.tokens_per_block <= 0:
            raise InvalidArgument("must be > 0", field="layout.tokens_per_block")
        if not reg.layout.regions:
            raise InvalidArgument("needs at least one KV region", field="layout.regions")
        for i, r in enumerate(reg.layout.regions):
            if r.block_len <= 0 or r.num_blocks <= 0 or r.base_addr <= 0:
                raise InvalidArgument(
                    "base_addr, block_len and num_blocks must be > 0", field=f"layout.regions[{i}]"
                )
        now = self._clock.monotonic()
        fenced = self.registry.hello(reg, now)
        effects: list[Effect] = []
        if fenced is not None:
            effects += self._fence(fenced)
        effects += self._replay_orders(reg.key, reg.incarnation)
        return effects

    def agent_seen(self, key: AgentKey, incarnation: str) -> bool:
        return self.registry.renew(key, incarnation, self._clock.monotonic())

    def agent_disconnected(self, key: AgentKey, incarnation: str) -> list[Effect]:
        if not self.registry.disconnected(key, incarnation):
            return []
        if not self.settings.fail_on_disconnect:
            return []
        effects: list[Effect] = []
        for t in self._transfers_of(key.engine_id):
            if t.state in _MOVING:
                effects += self._finish(
                    t, State.FAILED, Reason.AGENT_LOST, f"agent {key} disconnected"
                )
        return effects

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
    ) -> list[Effect]:
        t = self._transfers.get(transfer_id)
        rec = self._order_by_id(t, order_id) if t else None
        if t is None or rec is None:
            return []  # unknown or forgotten order: nothing to update
        if rec.agent != key or rec.order.prefill_incarnation != incarnation:
            raise PermissionDenied(f"order {order_id} was not issued to {key}@{incarnation}")
        if rec.state.resolved:
            return []  # duplicate report
        wall = self._clock.wall()
        effects: list[Effect] = [TransferChanged(t.transfer_id)]
        rank = rec.order.prefill_rank
        if status is WriteStatus.POSTED:
            rec.state = RankState.POSTED
            t.mark("write_posted", wall, rank)
            if t.state is State.ORDERED:
                t.state = State.WRITING
            return effects
        was_open = t.write_may_land
        rec.state = _RANK_OF_REPORT[status]
        rec.detail, rec.bytes, rec.descriptors = detail, nbytes, descriptors
        self._close_order(t, rec)
        t.mark(_WRITE_STAGE[rec.state], wall, rank)
        if t.state in _MOVING:
            if status is WriteStatus.FAILED:
                why = f"prefill rank {rank}: {detail or 'WRITE failed'}"
                effects += self._finish(t, State.FAILED, Reason.WRITE_FAILED, why)
            elif status is WriteStatus.DROPPED:
                why = f"prefill rank {rank} dropped the order: {detail or 'no reason given'}"
                effects += self._finish(t, State.FAILED, Reason.WRITE_FAILED, why)
            else:
                effects += self._maybe_complete(t)
        elif t.state.terminal and was_open and not t.write_may_land:
            effects += self._released(t)
        return effects

    def arrival_report(
        self, key: AgentKey, incarnation: str, transfer_id: str, prefill_ranks: Sequence[int]
    ) -> list[Effect]:
        t = self._transfers.get(transfer_id)
        if t is None or t.decode is None:
            return []
        if key.engine_id != t.decode.engine_id or not self.registry.is_current(key, incarnation):
            raise PermissionDenied(f"{key}@{incarnation} is not a decode rank of {transfer_id}")
        ranks = set(prefill_ranks)
        expected = t.expected.get(key.rank, frozenset())
        if not ranks <= expected:
            raise InvalidArgument(
                f"ranks {sorted(ranks - expected)} do not write into decode rank {key.rank}",
                field="arrival.prefill_ranks",
            )
        got = t.arrived.get(key.rank)
        if got is None:
            got = t.arrived[key.rank] = set()
        new = ranks - got
        if not new:
            return []
        got.update(new)
        wall = self._clock.wall()
        for p in sorted(new):
            t.mark("arrived", wall, p)
        effects: list[Effect] = [TransferChanged(t.transfer_id)]
        if t.state in _MOVING:
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
        if t is not None:
            if (t.announced_prefill, t.announced_decode) != (pe, de):
                raise Conflict(f"transfer {tid} was begun with other engines", field="transfer_id")
            return t, []
        t = self._create(tid, State.AWAITING, [e for e in (pe, de) if e])
        t.announced_prefill, t.announced_decode = pe, de
        t.mark("begun", t.created_wall)
        return t, [TransferChanged(tid)]

    def register_decode(
        self, transfer_id: str, engine: str, blocks: Sequence[Sequence[int]], num_tokens: int
    ) -> tuple[Transfer, list[Effect]]:
        return self._arrive(Role.DECODE, transfer_id, engine, blocks, num_tokens)

    def prefill_done(
        self, transfer_id: str, engine: str, blocks: Sequence[Sequence[int]], num_tokens: int
    ) -> tuple[Transfer, list[Effect]]:
        return self._arrive(Role.PREFILL, transfer_id, engine, blocks, num_tokens)

    def cancel(self, transfer_id: str, reason: str) -> tuple[Transfer, list[Effect]]:
        s = self.settings
        tid = validation.transfer_id(transfer_id, s.max_id_len)
        if len(reason) > 1024:
            raise InvalidArgument("longer than 1024 characters", field="reason")
        t = self._transfers.get(tid)
        detail = reason or "cancelled"
        if t is None:
            # A tombstone: a side that arrives later learns at once that it is cancelled.
            t = self._create(tid, State.AWAITING, [])
            t.mark("begun", t.created_wall)
        if t.state.terminal:
            return t, []
        return t, self._finish(t, State.CANCELLED, Reason.CANCELLED, detail)

    # ================================================================ time
    def tick(self) -> list[Effect]:
        now = self._clock.monotonic()
        effects: list[Effect] = []
        lost, gone = self.registry.expire(now)
        for rec in lost:
            effects += self._agent_lost(rec)
        for key, inc in gone:
            effects += self._resolve_agent_orders(key, inc, "replaced incarnation's lease over")
        while self._deadlines and self._deadlines[0][0] <= now:
            _, version, tid = heapq.heappop(self._deadlines)
            t = self._transfers.get(tid)
            if t is None or t.state.terminal or t.deadline_version != version:
                continue
            effects += self._finish(
                t, State.EXPIRED, Reason.DEADLINE, f"deadline passed in state {t.state.value}"
            )
        self._sweep_terminal(now)
        return effects

    def next_wakeup(self) -> float | None:
        """Monotonic time of the next deadline or lease expiry, if any."""
        candidates = [self._deadlines[0][0]] if self._deadlines else []
        nxt = self.registry.next_deadline()
        if nxt is not None:
            candidates.append(nxt)
        return min(candidates, default=None)

    # ================================================================ internals
    def _create(
        self,
        tid: TransferId,
        state: State,
        engines: Sequence[EngineId],
        now: float | None = None,
        wall: float | None = None,
    ) -> Transfer:
        """A new transfer; `now` and `wall` are the clocks, if the caller just read them."""
        s = self.settings
        if self._inflight >= s.max_inflight:
            raise ResourceExhausted(f"{self._inflight} transfers in flight (max {s.max_inflight})")
        for e in engines:
            if self._inflight_by_engine.get(e, 0) >= s.max_inflight_per_engine:
                raise ResourceExhausted(
                    f"engine {e} has {s.max_inflight_per_engine} transfers in flight"
                )
        if now is None or wall is None:
            now, wall = self._clock.monotonic(), self._clock.wall()
        t = Transfer(tid, state, now, wall, now, wall)
        self._transfers[tid] = t
        self._inflight += 1
        for e in engines:
            self._count_engine(t, e)
        self._set_deadline(t, s.rendezvous_timeout_s, now)
        return t

    def _set_deadline(self, t: Transfer, seconds: float, now: float | None = None) -> None:
        t.deadline_version += 1
        t.deadline_mono = (self._clock.monotonic() if now is None else now) + seconds
        heapq.heappush(self._deadlines, (t.deadline_mono, t.deadline_version, t.transfer_id))

    def _count_engine(self, t: Transfer, engine: EngineId) -> None:
        if engine in t.counted or t.state.terminal:
            return
        limit = self.settings.max_inflight_per_engine
        if self._inflight_by_engine.get(engine, 0) >= limit:
            raise ResourceExhausted(f"engine {engine} has {limit} transfers in flight")
        self._inflight_by_engine[engine] = self._inflight_by_engine.get(engine, 0) + 1
        t.counted.add(engine)

    def _arrive(
        self,
        role: Role,
        transfer_id: str,
        engine: str,
        blocks: Sequence[Sequence[int]],
        num_tokens: int,
    ) -> tuple[Transfer, list[Effect]]:
        s = self.settings
        field = "decode_engine_id" if role is Role.DECODE else "prefill_engine_id"
        t = self._transfers.get(transfer_id)
        # Ids already held (a known transfer, a registered engine) were validated then.
        tid = t.transfer_id if t is not None else validation.transfer_id(transfer_id, s.max_id_len)
        eng = self.registry.engine(engine)
        if eng is None or eng.role is not role:
            eid = validation.engine_id(engine, field=field, max_len=s.max_id_len)
            eng = self.registry.require_engine(eid, role, field_name=field)
        eid = eng.engine_id
        layout = eng.ranks[min(eng.ranks)].reg.layout
        checked = validation.blocks(
            blocks,
            field="block_ids",
            max_groups=s.max_groups,
            max_per_group=s.max_blocks_per_group,
            num_groups=layout.num_groups,
            num_blocks=layout.num_blocks,
        )
        validation.num_tokens(num_tokens)
        need = math.ceil(num_tokens / eng.tokens_per_block)
        for g, ids in enumerate(checked):
            if role is Role.DECODE and len(ids) > need:
                raise InvalidArgument(
                    f"{len(ids)} blocks for {num_tokens} tokens (at most {need})",
                    field=f"block_ids[{g}]",
                )
            if role is Role.PREFILL and len(ids) < need:
                raise InvalidArgument(
                    f"{len(ids)} blocks cannot hold {num_tokens} tokens (need {need})",
                    field=f"block_ids[{g}]",
                )
        side = Side(eid, checked, num_tokens)
        now, wall = self._clock.monotonic(), self._clock.wall()
        created = t is None
        if t is None:
            t = self._create(tid, State.AWAITING, [eid], now, wall)
        else:
            announced = t.announced_decode if role is Role.DECODE else t.announced_prefill
            if announced and announced != eid:
                raise Conflict(f"transfer {tid} was begun with {field} {announced}", field=field)
        current = t.decode if role is Role.DECODE else t.prefill
        if current is not None:
            if current != side:
                differs = next(
                    n
                    for n in ("engine_id", "blocks", "num_tokens")
                    if getattr(current, n) != getattr(side, n)
                )
                name = {"engine_id": field, "blocks": "block_ids", "num_tokens": "num_tokens"}
                raise Conflict(
                    f"transfer {tid} already has a different {role.value} report",
                    field=name[differs],
                )
            return t, []  # an idempotent retry
        if t.state.terminal:
            # Cancelled or expired before this side arrived: the answer says so,
            # and an engine the transfer did not name when it ended (so was not
            # told then) gets the terminal notice now, on every rank.
            if eid in (t.prefill_engine, t.decode_engine):
                return t, []
            return t, self._notify_engines(t, (eid,))
        self._count_engine(t, eid)
        effects: list[Effect] = [TransferChanged(tid)]
        if role is Role.DECODE:
            t.decode = side
            t.mark("decode_registered", wall)
        else:
            t.prefill = side
            t.mark("prefill_done", wall)
        if t.decode is not None and t.prefill is not None:
            effects += self._issue_orders(t)
        else:
            t.state = State.REGISTERED if role is Role.DECODE else State.PREFILL_DONE
            if not created:  # _create set this very deadline
                self._set_deadline(t, s.rendezvous_timeout_s, now)
        return t, effects

    def _issue_orders(self, t: Transfer) -> list[Effect]:
        assert t.decode is not None and t.prefill is not None
        pe = self.registry.engine(t.prefill.engine_id)
        de = self.registry.engine(t.decode.engine_id)
        if pe is None or de is None or not pe.ready or not de.ready:
            missing = t.prefill.engine_id if pe is None or not pe.ready else t.decode.engine_id
            return self._finish(t, State.FAILED, Reason.AGENT_LOST, f"engine {missing} not ready")
        problem = self._mismatch(t, pe, de)
        if problem:
            return self._finish(t, State.FAILED, Reason.MISMATCH, problem)
        if not any(t.decode.blocks):  # every group empty
            return self._finish(
                t, State.COMPLETE, Reason.NOTHING_TO_WRITE, "decode side had every block cached"
            )
        n_prompt_blocks = math.ceil(t.decode.num_tokens / de.tokens_per_block)
        src: list[tuple[int, ...]] = []
        for p_ids, d_ids in zip(t.prefill.blocks, t.decode.blocks, strict=True):
            prompt_ids = p_ids[:n_prompt_blocks]
            # A decode prefix hit registers only the tail: write the matching tail.
            src.append(prompt_ids[len(prompt_ids) - len(d_ids) :] if d_ids else ())
        s = self.settings
        self._set_deadline(t, s.write_timeout_s)
        wall = self._clock.wall()
        deadline_unix = wall + s.write_timeout_s
        effects: list[Effect] = []
        for rank in range(pe.tp_size):
            # Equal TP: prefill rank r writes whole blocks into decode rank r.
            p_agent, d_agent = pe.ranks[rank], de.ranks[rank]
            target = WriteTarget(
                decode_engine_id=de.engine_id,
                decode_rank=rank,
                decode_incarnation=d_agent.incarnation,
                src_blocks=tuple(src),
                dst_blocks=t.decode.blocks,
                expected_writers=1,
            )
            order = Order(
                order_id=OrderId(f"{self.coordinator_id}-{next(self._order_seq)}"),
                transfer_id=t.transfer_id,
                prefill_engine_id=pe.engine_id,
                prefill_rank=rank,
                prefill_incarnation=p_agent.incarnation,
                targets=(target,),
                deadline_unix=deadline_unix,
                num_tokens=t.decode.num_tokens,
            )
            t.orders[rank] = OrderRecord(order, p_agent.key)
            t.expected[rank] = frozenset((rank,))
            bucket_key = (p_agent.key, p_agent.incarnation)
            bucket = self._open_orders.get(bucket_key)
            if bucket is None:
                bucket = self._open_orders[bucket_key] = set()
            bucket.add((t.transfer_id, rank))
            effects.append(SendOrder(p_agent.key, p_agent.incarnation, order))
        t.state = State.ORDERED
        t.mark("ordered", wall)
        return effects

    @staticmethod
    def _mismatch(t: Transfer, pe: EngineRecord, de: EngineRecord) -> str:
        assert t.decode is not None and t.prefill is not None
        if pe.tp_size != de.tp_size:
            return f"prefill TP {pe.tp_size} != decode TP {de.tp_size} (not supported yet)"
        if pe.tokens_per_block != de.tokens_per_block:
            return f"tokens per block differ: {pe.tokens_per_block} vs {de.tokens_per_block}"
        if pe.compat_hash and de.compat_hash and pe.compat_hash != de.compat_hash:
            return "KV layouts are incompatible (compat_hash differs)"
        if t.decode.num_tokens != t.prefill.num_tokens:
            return f"num_tokens: decode {t.decode.num_tokens} != prefill {t.prefill.num_tokens}"
        if len(t.decode.blocks) != len(t.prefill.blocks):
            return "number of KV groups differs"
        p_regions = pe.ranks[0].reg.layout.regions
        d_regions = de.ranks[0].reg.layout.regions
        shape = [(r.block_len, r.group) for r in p_regions]
        if shape != [(r.block_len, r.group) for r in d_regions]:
            return "KV regions differ in count, group or block length"
        return ""

    def _maybe_complete(self, t: Transfer) -> list[Effect]:
        for o in t.orders.values():
            if o.state is not RankState.DONE:
                return []
        if t.all_arrived():
            return self._finish(t, State.COMPLETE, Reason.NONE, "")
        return []

    def _finish(self, t: Transfer, state: State, reason: Reason, detail: str) -> list[Effect]:
        """Enter a terminal state: cancel open orders and tell both engines."""
        assert state.terminal and not t.state.terminal
        t.state, t.reason, t.detail = state, reason, detail
        now = self._clock.monotonic()
        t.terminal_mono = now
        t.mark(_STAGE[state], self._clock.wall())
        self._inflight -= 1
        for e in t.counted:
            left = self._inflight_by_engine.get(e, 0) - 1
            if left > 0:
                self._inflight_by_engine[e] = left
            else:
                self._inflight_by_engine.pop(e, None)
        self._terminal.append(t.transfer_id)
        effects: list[Effect] = [TransferChanged(t.transfer_id)]
        for rec in t.orders.values():
            if rec.state.resolved:
                continue
            key = rec.agent
            inc = rec.order.prefill_incarnation
            if self.registry.may_still_act(key, inc, now):
                effects.append(SendCancelOrder(key, inc, rec.order.order_id, t.transfer_id, reason))
            else:
                rec.state, rec.detail = RankState.FAILED, "agent gone before it reported"
                self._close_order(t, rec)
        if state is not State.COMPLETE or reason is not Reason.NONE:
            effects += self._notify(t)  # a clean COMPLETE is known to every rank already
        return effects

    def _released(self, t: Transfer) -> list[Effect]:
        t.mark("released", self._clock.wall())
        return [TransferChanged(t.transfer_id), *self._notify(t)]

    def _notify(self, t: Transfer) -> list[Effect]:
        """The transfer's state, to every rank of the engines it names."""
        return self._notify_engines(t, {x for x in (t.prefill_engine, t.decode_engine) if x})

    def _notify_engines(self, t: Transfer, engines: Iterable[EngineId]) -> list[Effect]:
        notice = Notice(t.transfer_id, t.state, t.reason, t.detail, t.write_may_land)
        out: list[Effect] = []
        for e in engines:
            eng = self.registry.engine(e)
            if eng is None:
                continue
            for rec in eng.ranks.values():
                out.append(SendNotice(rec.key, rec.incarnation, notice))
        return out

    def _order_by_id(self, t: Transfer | None, order_id: str) -> OrderRecord | None:
        if t is None:
            return None
        for rec in t.orders.values():
            if rec.order.order_id == order_id:
                return rec
        return None

    def _close_order(self, t: Transfer, rec: OrderRecord) -> None:
        bucket = self._open_orders.get((rec.agent, rec.order.prefill_incarnation))
        if bucket is not None:
            bucket.discard((t.transfer_id, rec.order.prefill_rank))
            if not bucket:
                del self._open_orders[(rec.agent, rec.order.prefill_incarnation)]

    def _transfers_of(self, engine: EngineId) -> list[Transfer]:
        return [
            t
            for t in self._transfers.values()
            if not t.state.terminal and engine in (t.prefill_engine, t.decode_engine)
        ]

    def _replay_orders(self, key: AgentKey, incarnation: str) -> list[Effect]:
        """On (re)connect: resend open orders; cancel those whose transfer ended."""
        out: list[Effect] = []
        for tid, rank in sorted(self._open_orders.get((key, incarnation), ())):
            t = self._transfers[tid]
            rec = t.orders[rank]
            if t.state.terminal:
                out.append(SendCancelOrder(key, incarnation, rec.order.order_id, tid, t.reason))
            else:
                out.append(SendOrder(key, incarnation, rec.order))
        return out

    def _fence(self, old: AgentRecord) -> list[Effect]:
        effects: list[Effect] = []
        for t in self._transfers_of(old.key.engine_id):
            effects += self._finish(
                t,
                State.FAILED,
                Reason.AGENT_FENCED,
                f"agent {old.key} restarted (incarnation {old.incarnation} fenced)",
            )
        for eng in self.registry.engines():
            for rec in eng.ranks.values():
                if rec.key != old.key:
                    effects.append(
                        SendPeerFenced(rec.key, rec.incarnation, old.key, old.incarnation)
                    )
        return effects

    def _agent_lost(self, rec: AgentRecord) -> list[Effect]:
        effects: list[Effect] = []
        for t in self._transfers_of(rec.key.engine_id):
            effects += self._finish(
                t, State.FAILED, Reason.AGENT_LOST, f"agent {rec.key} lease expired"
            )
        effects += self._resolve_agent_orders(rec.key, rec.incarnation, "agent lease expired")
        for eng in self.registry.engines():
            for other in eng.ranks.values():
                effects.append(
                    SendPeerFenced(other.key, other.incarnation, rec.key, rec.incarnation)
                )
        return effects

    def _resolve_agent_orders(self, key: AgentKey, incarnation: str, why: str) -> list[Effect]:
        effects: list[Effect] = []
        for tid, rank in sorted(self._open_orders.pop((key, incarnation), set())):
            t = self._transfers.get(tid)
            if t is None:
                continue
            rec = t.orders[rank]
            if rec.state.resolved:
                continue
            was_open = t.write_may_land
            rec.state, rec.detail = RankState.FAILED, why
            if t.state.terminal:
                if was_open and not t.write_may_land:
                    effects += self._released(t)
            else:
                effects += self._finish(t, State.FAILED, Reason.AGENT_LOST, f"rank {rank}: {why}")
        return effects

    def _sweep_terminal(self, now: float) -> None:
        s = self.settings
        for _ in range(len(self._terminal)):
            tid = self._terminal[0]
            t = self._transfers.get(tid)
            if t is None:
                self._terminal.popleft()
                continue
            assert t.terminal_mono is not None
            too_many = len(self._terminal) > s.max_terminal
            if not too_many and now - t.terminal_mono < s.retention_s:
                break
            self._terminal.popleft()
            if t.write_may_land:
                self._terminal.append(tid)  # keep until no WRITE can land
                continue
            del self._transfers[tid]

    def has_transfer(self, transfer_id: str) -> bool:
        return transfer_id in self._transfers

    def transfer(self, transfer_id: str) -> Transfer | None:
        """The transfer, or None if unknown or forgotten."""
        return self._transfers.get(transfer_id)


def blocks_of(groups: Blocks) -> list[list[int]]:
    return [list(g) for g in groups]
