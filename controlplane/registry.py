"""Engines, their agent ranks, incarnations and leases. Plain Python."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from pushkv.controlplane.domain import AgentKey, AgentRegistration, EngineId, Role
from pushkv.controlplane.errors import FailedPrecondition, InvalidArgument, NoAgents, NotFound
from pushkv.rules.pairing import KVShape
from pushkv.rules.pp_map import merge_stages


@dataclass(slots=True)
class AgentRecord:
    reg: AgentRegistration
    connected: bool
    last_seen: float
    lease_deadline: float
    # Its stream closed and its reconnect grace runs (rendezvous.py): orders
    # to it wait for its hello (they are sent again then), as if connected.
    returning: bool = False

    @property
    def key(self) -> AgentKey:
        return self.reg.key

    @property
    def incarnation(self) -> str:
        return self.reg.incarnation


@dataclass(slots=True)
class EngineRecord:
    engine_id: EngineId
    role: Role
    tp_size: int
    tokens_per_block: int
    compat_hash: str
    ranks: dict[int, AgentRecord] = field(default_factory=dict)
    # Pipeline-parallel stages; ranks are numbered pp_rank * tp_size + tp_rank.
    pp_size: int = 1

    @property
    def size(self) -> int:
        """Ranks in all: every stage's."""
        return self.tp_size * self.pp_size

    @property
    def shape(self) -> KVShape:
        """What pairing reads (pushkv/rules/pairing.py): the first rank's layout, and
        with several PP stages, every registered stage's first rank's regions
        (pushkv/rules/pp_map.py). Some rank must be registered."""
        first = self.ranks[min(self.ranks)].reg.layout.shape
        if self.pp_size <= 1:
            return first
        stages = [self.ranks.get(s * self.tp_size) for s in range(self.pp_size)]
        return merge_stages([a.reg.layout.shape for a in stages if a is not None])

    @property
    def ready(self) -> bool:
        """Every rank registered, and connected or within its reconnect grace
        (`returning`): the coordinator orders transfers for it (a returning
        rank's orders wait for its hello)."""
        if len(self.ranks) != self.size:
            return False
        for a in self.ranks.values():  # noqa: SIM110 (all() over a generator is slower)
            if not (a.connected or a.returning):
                return False
        return True


class Registry:
    def __init__(self, lease_s: float, silent_s: float | None = None) -> None:
        self._lease_s = lease_s
        # A connected agent past its lease is lost only this long after it was
        # last heard from (CoreSettings.silent_agent_s).
        self._silent_s = lease_s if silent_s is None else max(silent_s, lease_s)
        self._engines: dict[str, EngineRecord] = {}
        # Incarnations replaced or lost while their process may still run:
        # (key, incarnation) -> the moment its lease is certainly over.
        self._ghosts: dict[tuple[AgentKey, str], float] = {}
        # At most the earliest lease or ghost deadline: every one set lowers
        # it, and `expire` scans the agents only once it has passed (the tick
        # runs every few ms under load, and 1,000 agents take a scan).
        self._check_at = math.inf

    # ------------------------------------------------------------- queries
    def engines(self) -> Iterator[EngineRecord]:
        return iter(self._engines.values())

    def engine(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def require_engine(self, engine_id: EngineId, role: Role, *, field_name: str) -> EngineRecord:
        eng = self._engines.get(engine_id)
        if eng is None:
            raise NoAgents(f"engine {engine_id!r} has no registered agents", field=field_name)
        if eng.role is not role:
            raise FailedPrecondition(
                f"engine {engine_id!r} registered as {eng.role.value}, not {role.value}",
                field=field_name,
            )
        return eng

    def agent(self, key: AgentKey) -> AgentRecord | None:
        eng = self._engines.get(key.engine_id)
        return eng.ranks.get(key.rank) if eng else None

    def is_current(self, key: AgentKey, incarnation: str) -> bool:
        rec = self.agent(key)
        return rec is not None and rec.incarnation == incarnation

    def may_still_act(self, key: AgentKey, incarnation: str, now: float) -> bool:
        """Whether that incarnation could still post a WRITE (it holds a lease)."""
        if self.is_current(key, incarnation):
            return True
        deadline = self._ghosts.get((key, incarnation))
        return deadline is not None and now < deadline

    # ------------------------------------------------------------- changes
    def hello(self, reg: AgentRegistration, now: float) -> AgentRecord | None:
        """Register or reconnect; returns the record it fenced, if any."""
        if reg.tp_size < 1 or not 0 <= reg.tp_rank < reg.tp_size:
            raise InvalidArgument(
                f"tp_rank {reg.tp_rank} outside tp_size {reg.tp_size}", field="identity.tp_rank"
            )
        if reg.pp_size < 1 or not 0 <= reg.pp_rank < reg.pp_size:
            raise InvalidArgument(
                f"pp_rank {reg.pp_rank} outside pp_size {reg.pp_size}", field="identity.pp_rank"
            )
        eng = self._engines.get(reg.engine_id)
        if eng is not None and eng.ranks:
            if eng.role is not reg.role:
                raise FailedPrecondition(
                    f"engine {reg.engine_id!r} is registered as {eng.role.value}",
                    field="identity.role",
                )
            if eng.tp_size != reg.tp_size:
                raise FailedPrecondition(
                    f"engine {reg.engine_id!r} is registered with tp_size {eng.tp_size}",
                    field="identity.tp_size",
                )
            if eng.pp_size != reg.pp_size:
                raise FailedPrecondition(
                    f"engine {reg.engine_id!r} is registered with pp_size {eng.pp_size}",
                    field="identity.pp_size",
                )
            if eng.tokens_per_block != reg.layout.tokens_per_block:
                raise FailedPrecondition(
                    f"engine {reg.engine_id!r} uses {eng.tokens_per_block} tokens per block",
                    field="layout.tokens_per_block",
                )
        if eng is None or not eng.ranks:
            eng = EngineRecord(
                reg.engine_id,
                reg.role,
                reg.tp_size,
                reg.layout.tokens_per_block,
                reg.layout.compat_hash,
                pp_size=reg.pp_size,
            )
            self._engines[reg.engine_id] = eng
        rank = reg.key.rank
        old = eng.ranks.get(rank)
        rec = AgentRecord(reg, True, now, now + self._lease_s)
        eng.ranks[rank] = rec
        self._check_at = min(self._check_at, rec.lease_deadline)
        if old is not None and old.incarnation != reg.incarnation:
            self._ghosts[(old.key, old.incarnation)] = old.lease_deadline
            self._check_at = min(self._check_at, old.lease_deadline)
            return old
        return None

    def renew(self, key: AgentKey, incarnation: str, now: float) -> bool:
        rec = self.agent(key)
        if rec is None or rec.incarnation != incarnation:
            return False
        rec.last_seen = now
        rec.lease_deadline = deadline = now + self._lease_s
        self._check_at = min(self._check_at, deadline)
        rec.connected = True
        return True

    def disconnected(self, key: AgentKey, incarnation: str) -> bool:
        rec = self.agent(key)
        if rec is None or rec.incarnation != incarnation:
            return False
        rec.connected = False
        # Past its lease it is due now: only its open stream kept it.
        self._check_at = min(self._check_at, rec.lease_deadline)
        return True

    def expire(self, now: float) -> tuple[list[AgentRecord], list[tuple[AgentKey, str]]]:
        """Drop agents whose lease ran out (a connected one: that and
        `silent_s` since it was last heard); return them and the ghosts now
        surely gone."""
        lost: list[AgentRecord] = []
        gone: list[tuple[AgentKey, str]] = []
        if now < self._check_at:
            return lost, gone
        earliest = math.inf
        for eng in list(self._engines.values()):
            for rank, rec in list(eng.ranks.items()):
                due = rec.lease_deadline
                if due <= now and rec.connected:
                    # Its stream is open, so its process answers keepalive
                    # pings: a starved process, not a dead one.
                    due = rec.last_seen + self._silent_s
                if due <= now:
                    del eng.ranks[rank]
                    lost.append(rec)
                elif due < earliest:
                    earliest = due
            if not eng.ranks:
                del self._engines[eng.engine_id]
        for ghost, deadline in list(self._ghosts.items()):
            if deadline <= now:
                del self._ghosts[ghost]
                gone.append(ghost)
            elif deadline < earliest:
                earliest = deadline
        self._check_at = earliest
        return lost, gone

    def next_deadline(self) -> float | None:
        """No later than the earliest lease or ghost deadline (a renewal since
        the last scan may have moved it on: the tick then scans, finds none due,
        and learns the next)."""
        return None if self._check_at == math.inf else self._check_at

    def require_agent(self, key: AgentKey) -> AgentRecord:
        rec = self.agent(key)
        if rec is None:
            raise NotFound(f"agent {key} is not registered")
        return rec
