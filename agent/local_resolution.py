"""What the NIXL thread (agent/dataplane.py) resolves itself when its
coordinator is lost, replaced, or takes it back: the rules that keep a WRITE
from landing in freed blocks and a block from staying held for good.

- A restarted coordinator (it forgot every transfer), or one gone for
  give_up_s: every order held unposted is dropped, blocks freed, decode
  transfers fail once no prefill agent can post any more.
- The same coordinator back after this agent's lease lapsed: orders held
  unposted are dropped (it resolved them when the lease ended).
- Transfers a cut hello left out: dropped and freed (prefill).
- A newer leader adopting: nothing resolved; old-term armed orders refused.

A mixin of DataPlane: the state it reads is DataPlane's, on its thread only.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from pushkv.agent.armed import Armed
from pushkv.agent.arrivals import Arrivals
from pushkv.agent.events import EventKind
from pushkv.agent.messages import OrderMsg, ReportStatus
from pushkv.agent.posting import InFlight
from pushkv.agent.progressive import Progressive

log = logging.getLogger("pushkv.agent")


class LocalResolution:
    _prefill: bool
    _queued: OrderedDict[str, OrderMsg]
    _inflight: dict[str, InFlight]
    _held: set[str]
    _armed: Armed
    _partial: Progressive
    _arrivals: Arrivals
    _term: int
    _give_up_at: float
    _frozen: bool

    if TYPE_CHECKING:  # DataPlane's

        def _finish(self, order: OrderMsg, status: ReportStatus, detail: str) -> None: ...
        def _free(self, tid: str, detail: str) -> None: ...
        def _busy(self, tid: str) -> bool: ...
        def _tell(self, kind: EventKind, tid: str, detail: str) -> None: ...
        def _refuse(self, order: OrderMsg) -> None: ...

    def _on_coordinator_changed(self, lease_s: float) -> None:
        """The coordinator restarted and forgot every transfer: resolve ours locally.

        Prefill: queued orders are dropped (never posted); posted WRITEs finish.
        Decode: transfers still missing ranks fail once no prefill agent can post
        any more: every agent stops posting when its lease lapses, and no lease
        given by the old coordinator outlives now + lease_s.
        """
        log.warning("coordinator changed: resolving in-flight transfers locally")
        busy = self._drop_unposted(
            "coordinator restarted before posting", "coordinator restarted mid-prefill"
        )
        for tid in list(self._held - busy):
            self._free(tid, "coordinator restarted; transfer abandoned")
        if not self._prefill:
            self._arrivals.fail_all_at(time.monotonic() + lease_s)

    def _on_lease_lapsed(self) -> None:
        """Back at the same coordinator after this agent's lease lapsed (it
        resolved every order it gave us): the orders held unposted are dropped,
        posted WRITEs finish. Else an order of a transfer that ended there and
        that the hello did not list (cut at its bound) would be posted."""
        why = "agent lease lapsed while the coordinator was unreachable"
        if self._prefill:
            self._drop_unposted(f"{why}; not posting", f"{why} (mid-prefill)")

    def _on_left_out(self, transfer_ids: tuple[str, ...]) -> None:
        """Prefill: transfers the hello left out (over its bound), which the
        welcoming leader keeps or adopts without knowing what we hold of them:
        it may never tell of their end, so their unposted orders are dropped
        and their blocks freed (a later order for one is refused, "blocks
        released": the transfer fails cleanly). Decode: expectations stay
        (they end at their deadline)."""
        if not self._prefill:
            return
        left, why = set(transfer_ids), "left out of the hello (over its bound)"
        queued = [o for o in self._queued.values() if o.transfer_id in left]
        for order in [*queued, *filter(None, map(self._armed.drop, transfer_ids))]:
            self._queued.pop(order.order_id, None)
            self._finish(order, ReportStatus.DROPPED, f"{why}; not posting")
        for tid in sorted(left & self._held):
            if not self._busy(tid):
                self._free(tid, f"{why}; transfer abandoned")

    def _drop_unposted(self, why: str, mid: str) -> set[str]:
        """Every order held unposted (queued or armed: `why`; the rest of a
        partial one: `mid`) is dropped, reported so, never posted; returns the
        transfers with WRITEs in flight (their blocks freed once those settle)."""
        dropped = [*self._queued.values(), *self._armed.take_all()]
        self._queued.clear()
        for order in dropped:
            self._finish(order, ReportStatus.DROPPED, why)
        busy = {f.order.transfer_id for f in self._inflight.values()}
        return busy | self._partial.stop_all(mid)

    def _on_adopted(self) -> None:
        """A newer leader adopts our transfers from the hello: nothing is resolved
        here. Old-term orders are refused (armed: now; queued: at `_post_queued`)."""
        log.warning("a newer leader (term %d) adopts this agent's transfers", self._term)
        for order in self._armed.take_all():
            if order.term < self._term:
                self._refuse(order)
            else:
                self._armed.arm(order)

    def _give_up(self) -> None:
        """The coordinator has been gone for give_up_s: longer than its write
        timeout plus a lease, so no prefill agent can post any more (each stops
        when its lease lapses, and every order's deadline has passed). Resolve
        every transfer locally, as the coordinator would have."""
        self._give_up_at, self._frozen = 0.0, False
        log.warning("coordinator still unreachable: resolving in-flight transfers locally")
        busy = self._drop_unposted(
            "coordinator unreachable; not posting", "coordinator unreachable mid-prefill"
        )
        for tid in list(self._held - busy):
            self._free(tid, "coordinator unreachable; transfer abandoned")
        for tid in list(self._arrivals):
            self._tell(EventKind.KV_FAILED, tid, "coordinator unreachable; no WRITE can land")
