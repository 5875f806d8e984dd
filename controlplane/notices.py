"""The effects that tell agents what happened: a transfer's state to every rank
of the engines it names, and a fenced peer to every agent. Plain Python, no
gRPC; the transport delivers them."""

from __future__ import annotations

from collections.abc import Iterable

from pushkv.controlplane.domain import (
    AgentKey,
    Effect,
    EngineId,
    Notice,
    SendNotice,
    SendPeerFenced,
)
from pushkv.controlplane.registry import Registry
from pushkv.controlplane.transfer import Transfer


def transfer_notices(registry: Registry, t: Transfer, engines: Iterable[EngineId]) -> list[Effect]:
    """The transfer's state, to every rank of each registered engine in `engines`."""
    notice = Notice(t.transfer_id, t.state, t.reason, t.detail, t.write_may_land)
    out: list[Effect] = []
    for e in engines:
        eng = registry.engine(e)
        if eng is None:
            continue
        for rec in eng.ranks.values():
            out.append(SendNotice(rec.key, rec.incarnation, notice))
    return out


def peer_fenced(
    registry: Registry, key: AgentKey, incarnation: str, *, tell_same_key: bool
) -> list[Effect]:
    """To every registered agent (the one now holding `key` too, if `tell_same_key`):
    the agent `key`'s incarnation `incarnation` is fenced."""
    out: list[Effect] = []
    for eng in registry.engines():
        for rec in eng.ranks.values():
            if tell_same_key or rec.key != key:
                out.append(SendPeerFenced(rec.key, rec.incarnation, key, incarnation))
    return out
