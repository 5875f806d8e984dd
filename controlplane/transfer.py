"""One transfer's record. Transitions live in controlplane.rendezvous."""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.domain import (
    AgentKey,
    Blocks,
    EngineId,
    Order,
    RankState,
    Reason,
    State,
    TransferId,
)

_RESOLVED = frozenset({RankState.DONE, RankState.FAILED, RankState.DROPPED})


@dataclass(slots=True)
class OrderRecord:
    order: Order
    # The prefill agent the order went to: (order.prefill_engine_id, order.prefill_rank).
    agent: AgentKey
    state: RankState = RankState.ORDERED
    detail: str = ""
    bytes: int = 0
    descriptors: int = 0


@dataclass(slots=True)
class Side:
    """What one engine said about the transfer."""

    engine_id: EngineId
    blocks: Blocks
    num_tokens: int


@dataclass(slots=True)
class Transfer:
    transfer_id: TransferId
    state: State
    created_mono: float
    created_wall: float
    deadline_mono: float
    updated_wall: float
    reason: Reason = Reason.NONE
    detail: str = ""
    announced_prefill: EngineId | None = None
    announced_decode: EngineId | None = None
    decode: Side | None = None
    prefill: Side | None = None
    orders: dict[int, OrderRecord] = field(default_factory=dict)
    # decode rank -> prefill ranks expected to write into it / already arrived
    expected: dict[int, frozenset[int]] = field(default_factory=dict)
    arrived: dict[int, set[int]] = field(default_factory=dict)
    # (stage, unix seconds, rank or -1)
    timeline: list[tuple[str, float, int]] = field(default_factory=list)
    terminal_mono: float | None = None
    # Bumped on every deadline change so stale heap entries are ignored.
    deadline_version: int = 0
    # Engines whose in-flight count includes this transfer.
    counted: set[EngineId] = field(default_factory=set)

    @property
    def prefill_engine(self) -> EngineId | None:
        return self.prefill.engine_id if self.prefill else self.announced_prefill

    @property
    def decode_engine(self) -> EngineId | None:
        return self.decode.engine_id if self.decode else self.announced_decode

    @property
    def write_may_land(self) -> bool:
        for o in self.orders.values():  # noqa: SIM110 (any() over a generator is slower)
            if o.state not in _RESOLVED:
                return True
        return False

    def outstanding_ranks(self) -> list[int]:
        """Prefill ranks whose WRITE is not done or whose arrival is not counted."""
        if not self.orders:
            return []
        arrived = {p for ranks in self.arrived.values() for p in ranks}
        return sorted(
            r for r, o in self.orders.items() if o.state is not RankState.DONE or r not in arrived
        )

    def all_arrived(self) -> bool:
        arrived = self.arrived
        for d, exp in self.expected.items():
            got = arrived.get(d)
            if (exp and got is None) or (got is not None and not got >= exp):
                return False
        return True

    def mark(self, stage: str, wall: float, rank: int = -1) -> None:
        self.timeline.append((stage, wall, rank))
        self.updated_wall = wall
