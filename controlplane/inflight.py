"""The transfers a rendezvous holds, their in-flight counts, and how one ends.
Plain Python, no gRPC; the rendezvous state machine (rendezvous.py) decides
when, and delivers nothing itself: `finish` and `released` return effects.

- A transfer is created under the in-flight limits (`max_inflight`, and
  `max_inflight_per_engine` for each engine it names), unless `limits` is
  off (a tombstone, a transfer counted at an older leader); it counts once
  against each engine it names until it ends.
- Ending it (`finish`) releases those counts, keeps it for the retention
  period, cancels each unresolved order (resolved FAILED instead when its
  agent may no longer act) and tells both engines, except after a clean
  COMPLETE, which every rank knows already.
"""

from __future__ import annotations

from collections.abc import Sequence

from pushkv.controlplane.clock import Clock
from pushkv.controlplane.domain import (
    Effect,
    EngineId,
    RankState,
    Reason,
    SendCancelOrder,
    State,
    TransferChanged,
    TransferId,
)
from pushkv.controlplane.errors import ResourceExhausted
from pushkv.controlplane.expiry import Deadlines, Retention
from pushkv.controlplane.notices import transfer_notices
from pushkv.controlplane.orders import OpenOrders
from pushkv.controlplane.registry import Registry
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.transfer import Transfer

# Timeline stage names, without an Enum .value lookup (a Python property) per event.
_STAGE = {st: st.value for st in State}


class InFlight:
    """The transfer table, its counts, deadlines, retention and open orders."""

    def __init__(self, settings: CoreSettings, clock: Clock, registry: Registry) -> None:
        self.settings = settings
        self._clock = clock
        self.registry = registry
        # Keyed by plain str: lookups need no TransferId() call (ids in it were validated).
        self.transfers: dict[str, Transfer] = {}
        # The ones not ended (terminal ones stay in `transfers` for retention,
        # up to max_terminal): what an agent's loss scans, per agent.
        self.live: dict[str, Transfer] = {}
        self.count = 0
        self.begun = 0  # transfers created, ever (the GC policy's sign of work)
        self.by_engine: dict[EngineId, int] = {}
        self.deadlines = Deadlines()
        self.retention = Retention(settings)
        self.open_orders = OpenOrders()

    def create(
        self,
        tid: TransferId,
        state: State,
        engines: Sequence[EngineId],
        now: float | None = None,
        wall: float | None = None,
        limits: bool = True,
    ) -> Transfer:
        """A new transfer; `now` and `wall` are the clocks, if the caller just read them."""
        s = self.settings
        if limits and self.count >= s.max_inflight:
            raise ResourceExhausted(f"{self.count} transfers in flight (max {s.max_inflight})")
        for e in engines:
            if self.by_engine.get(e, 0) >= s.max_inflight_per_engine:
                raise ResourceExhausted(
                    f"engine {e} has {s.max_inflight_per_engine} transfers in flight"
                )
        if now is None or wall is None:
            now, wall = self._clock.monotonic(), self._clock.wall()
        t = Transfer(tid, state, now, wall, now, wall)
        self.transfers[tid] = t
        self.live[tid] = t
        self.count += 1
        self.begun += 1
        for e in engines:
            self.count_engine(t, e)
        self.deadlines.set(t, s.rendezvous_timeout_s, now)
        return t

    def count_engine(self, t: Transfer, engine: EngineId, limit: bool = True) -> None:
        if engine in t.counted or t.state.terminal:
            return
        most = self.settings.max_inflight_per_engine
        if limit and self.by_engine.get(engine, 0) >= most:
            raise ResourceExhausted(f"engine {engine} has {most} transfers in flight")
        self.by_engine[engine] = self.by_engine.get(engine, 0) + 1
        t.counted = (*t.counted, engine)

    def of_engine(self, engine: EngineId) -> list[Transfer]:
        """The transfers not ended that name `engine`."""
        return [t for t in self.live.values() if engine in (t.prefill_engine, t.decode_engine)]

    def tombstone(
        self, tid: TransferId, reason: Reason, detail: str
    ) -> tuple[Transfer, list[Effect]]:
        """A transfer not seen here, recorded only to be ended FAILED: a side
        that comes later is answered its end (no in-flight limit applies)."""
        t = self.create(tid, State.AWAITING, [], limits=False)
        t.mark("begun", t.created_wall)
        return t, self.finish(t, State.FAILED, reason, detail)

    def finish(self, t: Transfer, state: State, reason: Reason, detail: str) -> list[Effect]:
        """Enter a terminal state: cancel open orders and tell both engines."""
        assert state.terminal and not t.state.terminal
        t.state, t.reason, t.detail = state, reason, detail
        t.adopting = False
        now = self._clock.monotonic()
        t.terminal_mono = now
        t.mark(_STAGE[state], self._clock.wall())
        self.count -= 1
        self.live.pop(t.transfer_id, None)
        for e in t.counted:
            left = self.by_engine.get(e, 0) - 1
            if left > 0:
                self.by_engine[e] = left
            else:
                self.by_engine.pop(e, None)
        self.retention.add(t.transfer_id)
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
                self.open_orders.close(rec)
        if state is not State.COMPLETE or reason is not Reason.NONE:
            effects += self.notify(t)  # a clean COMPLETE is known to every rank already
        if not t.write_may_land:
            t.compact()  # retained for status only from here on
        return effects

    def released(self, t: Transfer) -> list[Effect]:
        """A terminal transfer's last WRITE may no longer land: both engines are told."""
        t.mark("released", self._clock.wall())
        t.compact()
        return [TransferChanged(t.transfer_id), *self.notify(t)]

    def notify(self, t: Transfer) -> list[Effect]:
        """The transfer's state, to every rank of the engines it names."""
        engines = {x for x in (t.prefill_engine, t.decode_engine) if x}
        return transfer_notices(self.registry, t, engines)
