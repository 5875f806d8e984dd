"""An agent incarnation gone: the transfers of its engine end, its orders are
resolved, and every agent learns the incarnation is fenced. Plain Python, no
gRPC; the rendezvous state machine (rendezvous.py) calls these on a hello that
replaces a live incarnation (`fenced`), a lapsed lease (`lost`), a closed
stream not reopened within the reconnect grace (`Away`, `grace_over`), and
a replaced incarnation's lease running out (`resolve_orders`).

A prefill agent lost after decode counted every WRITE of a transfer as
arrived does not fail it: NIXL delivers a WRITE's notification only once its
data has landed, and decode already runs on that KV. Only the agent's done
report is missing, so its orders resolve as landed (`landed`), and the
transfer completes once no other rank's report is pending.
"""

from __future__ import annotations

from pushkv.controlplane.domain import (
    MOVING,
    AgentKey,
    AgentNotBack,
    Effect,
    RankState,
    Reason,
    State,
    TransferChanged,
)
from pushkv.controlplane.inflight import InFlight
from pushkv.controlplane.notices import peer_fenced
from pushkv.controlplane.registry import AgentRecord
from pushkv.controlplane.transfer import Transfer

# The detail of an order whose agent was lost after its WRITE was counted.
LANDED = "landed (decode counted its arrival); the agent was lost before it reported"


def delivered(t: Transfer, prefill: AgentKey) -> bool:
    """Whether `t` needs nothing more of prefill agent `prefill` but its
    done report: every WRITE it was ordered arrived at decode."""
    return (
        t.state in MOVING
        and not t.adopting
        and t.prefill_engine == prefill.engine_id
        and bool(t.orders)
        and t.all_arrived()
    )


def landed(book: InFlight, t: Transfer, key: AgentKey, incarnation: str) -> list[Effect]:
    """`t` is `delivered` and agent `key`@`incarnation` is gone: its orders
    resolve as DONE, and `t` completes unless another rank's report is due."""
    for rec in t.orders.values():
        mine = rec.agent == key and rec.order.prefill_incarnation == incarnation
        if mine and not rec.state.resolved:
            rec.state, rec.detail = RankState.DONE, LANDED
            book.open_orders.close(rec)
    if all(rec.state is RankState.DONE for rec in t.orders.values()):
        return book.finish(t, State.COMPLETE, Reason.NONE, "")
    return [TransferChanged(t.transfer_id)]


def _gone(
    book: InFlight, key: AgentKey, incarnation: str, reason: Reason, why: str, *, moving: bool
) -> tuple[list[Effect], int]:
    """Agent `key`@`incarnation` is gone: its engine's transfers not ended
    (`moving`: only those moving) fail, but those it had `delivered`, which
    complete without its report. Returns the effects and how many failed."""
    effects: list[Effect] = []
    failed = 0
    for t in book.of_engine(key.engine_id):
        if delivered(t, key):
            effects += landed(book, t, key, incarnation)
        elif not moving or t.state in MOVING:
            effects += book.finish(t, State.FAILED, reason, why)
            failed += 1
    return effects, failed


def fenced(book: InFlight, old: AgentRecord) -> list[Effect]:
    """A new incarnation of `old`'s agent said hello: the older one is fenced."""
    why = f"agent {old.key} restarted (incarnation {old.incarnation} fenced)"
    effects, _ = _gone(book, old.key, old.incarnation, Reason.AGENT_FENCED, why, moving=False)
    effects += peer_fenced(book.registry, old.key, old.incarnation, tell_same_key=False)
    return effects


def disconnected(book: InFlight, key: AgentKey, incarnation: str, why: str) -> list[Effect]:
    """Agent `key`'s stream closed and it is taken as gone: its engine's
    moving transfers fail (its lease, and so its registration, runs on: the
    same incarnation may still come back; what it still reports is taken)."""
    effects, failed = _gone(book, key, incarnation, Reason.AGENT_LOST, why, moving=True)
    effects.append(AgentNotBack(key, incarnation, failed))
    return effects


def grace_over(
    book: InFlight, key: AgentKey, incarnation: str, fails: bool, grace_s: float
) -> list[Effect]:
    """Agent `key`'s reconnect grace ended without its hello: its engine is
    not ready, and its moving transfers fail (`fails`) or wait for its lease."""
    rec = book.registry.agent(key)
    if rec is None or rec.incarnation != incarnation or not rec.returning:
        return []
    rec.returning = False
    if not fails:
        return [AgentNotBack(key, incarnation, 0)]
    why = f"agent {key} disconnected and not back within {grace_s:g} s"
    return disconnected(book, key, incarnation, why)


class Away:
    """Agents whose stream closed, until they say hello again (`back`) or
    their reconnect grace ends (`due`): (key, incarnation) -> the deadline,
    and whether the agent's engine's moving transfers then fail."""

    def __init__(self) -> None:
        self._until: dict[tuple[AgentKey, str], tuple[float, bool]] = {}

    def left(self, key: AgentKey, incarnation: str, until: float, *, fails: bool) -> None:
        self._until[(key, incarnation)] = (until, fails)

    def back(self, key: AgentKey) -> None:
        """A hello from `key` (any incarnation: a new one fences the old)."""
        if self._until:
            for k in [k for k in self._until if k[0] == key]:
                del self._until[k]

    def due(self, now: float) -> list[tuple[AgentKey, str, bool]]:
        """The agents whose grace is over, forgotten here, and whether each
        fails its engine's moving transfers."""
        over = [(k, fails) for k, (until, fails) in self._until.items() if until <= now]
        for k, _ in over:
            del self._until[k]
        return [(k[0], k[1], fails) for k, fails in over]

    def earliest(self) -> float | None:
        return min((until for until, _ in self._until.values()), default=None)


def lost(book: InFlight, rec: AgentRecord) -> list[Effect]:
    """The lease of agent `rec` lapsed."""
    why = f"agent {rec.key} lease expired"
    effects, _ = _gone(book, rec.key, rec.incarnation, Reason.AGENT_LOST, why, moving=False)
    effects += resolve_orders(book, rec.key, rec.incarnation, "agent lease expired")
    effects += peer_fenced(book.registry, rec.key, rec.incarnation, tell_same_key=True)
    return effects


def resolve_orders(book: InFlight, key: AgentKey, incarnation: str, why: str) -> list[Effect]:
    """The orders still open on agent `key`'s incarnation `incarnation`: FAILED."""
    effects: list[Effect] = []
    for tid, rank in book.open_orders.pop(key, incarnation):
        t = book.transfers.get(tid)
        if t is None:
            continue
        rec = t.orders[rank]
        if rec.state.resolved:
            continue
        was_open = t.write_may_land
        rec.state, rec.detail = RankState.FAILED, why
        if t.state.terminal:
            if was_open and not t.write_may_land:
                effects += book.released(t)
        else:
            effects += book.finish(t, State.FAILED, Reason.AGENT_LOST, f"rank {rank}: {why}")
    return effects
