"""The PeerInfo message each write target is introduced with, built once per
incarnation and shared by every session that learns of it.

A prefill agent is told of each decode rank it will write into once per
session (`Runtime._ensure_peer`), so a cluster of P prefill and D decode ranks
introduces up to P x D pairs, each with the same message per decode rank. Its
layout has a region per layer (or two): for a 64-layer model, 128 regions and
about 11 KB, some 260 us to build against about 50 us to copy into an agent's
batch. Messages are never mutated once built (a batch copies what it appends),
so one object serves every session.
"""

from __future__ import annotations

from pushkv.controlplane import convert
from pushkv.controlplane.domain import AgentKey
from pushkv.controlplane.registry import AgentRecord, Registry
from pushkv.v1 import pushkv_pb2 as pb

# Pruned when it grows past twice its size after the last pruning (at least
# this): entries of ranks gone or re-registered go, so the cache follows the
# registry instead of every engine id ever seen.
MIN_PRUNE_AT = 256


class PeerMessages:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._msgs: dict[AgentKey, tuple[str, pb.CoordinatorMessage]] = {}
        self._prune_at = MIN_PRUNE_AT

    def __len__(self) -> int:
        return len(self._msgs)

    def get(self, rec: AgentRecord) -> pb.CoordinatorMessage:
        """The peer message of `rec`'s current incarnation (shared: not to be mutated)."""
        hit = self._msgs.get(rec.key)
        if hit is not None and hit[0] == rec.incarnation:
            return hit[1]
        msg = pb.CoordinatorMessage(peer=convert.peer_to_pb(rec.reg))
        self._msgs[rec.key] = (rec.incarnation, msg)
        if len(self._msgs) > self._prune_at:
            self._prune()
        return msg

    def _prune(self) -> None:
        """Keep only entries of ranks registered now, with that incarnation."""
        live = {}
        for key, (inc, msg) in self._msgs.items():
            eng = self._registry.engine(key.engine_id)
            rec = eng.ranks.get(key.rank) if eng is not None else None
            if rec is not None and rec.incarnation == inc:
                live[key] = (inc, msg)
        self._msgs = live
        self._prune_at = max(MIN_PRUNE_AT, 2 * len(live))
