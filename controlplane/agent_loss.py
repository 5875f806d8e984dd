"""An agent incarnation gone: the transfers of its engine end, its orders are
resolved, and every agent learns the incarnation is fenced. Plain Python, no
gRPC; the rendezvous state machine (rendezvous.py) calls these on a hello that
replaces a live incarnation (`fenced`), a lapsed lease (`lost`), and a
replaced incarnation's lease running out (`resolve_orders`).
"""

from __future__ import annotations

from controlplane.domain import AgentKey, Effect, RankState, Reason, State
from controlplane.inflight import InFlight
from controlplane.notices import peer_fenced
from controlplane.registry import AgentRecord


def fenced(book: InFlight, old: AgentRecord) -> list[Effect]:
    """A new incarnation of `old`'s agent said hello: the older one is fenced."""
    effects: list[Effect] = []
    for t in book.of_engine(old.key.engine_id):
        effects += book.finish(
            t,
            State.FAILED,
            Reason.AGENT_FENCED,
            f"agent {old.key} restarted (incarnation {old.incarnation} fenced)",
        )
    effects += peer_fenced(book.registry, old.key, old.incarnation, tell_same_key=False)
    return effects


def lost(book: InFlight, rec: AgentRecord) -> list[Effect]:
    """The lease of agent `rec` lapsed."""
    effects: list[Effect] = []
    for t in book.of_engine(rec.key.engine_id):
        effects += book.finish(t, State.FAILED, Reason.AGENT_LOST, f"agent {rec.key} lease expired")
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
