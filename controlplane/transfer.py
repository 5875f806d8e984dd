"""One transfer's record. Transitions live in controlplane.rendezvous."""

from __future__ import annotations

from dataclasses import dataclass

from pushkv.controlplane.domain import (
    AgentKey,
    EngineId,
    Order,
    RankState,
    Reason,
    State,
    TransferId,
    WriteTarget,
)
from pushkv.rules import block_groups
from pushkv.rules.block_groups import BlockGroups

_RESOLVED = frozenset({RankState.DONE, RankState.FAILED, RankState.DROPPED})
_NO_RANKS: frozenset[int] = frozenset()
# A compacted order's targets (Transfer.compact): one shared target with no
# blocks. Not empty, so that `arrived_ranks` still tells a rank that had
# targets from one that never had any.
_NONE = block_groups.none(0)
SETTLED_TARGETS: tuple[WriteTarget, ...] = (WriteTarget(EngineId(""), -1, "", _NONE, _NONE, 0),)


# The records below write their own __init__ (init=False): a dataclass-made
# __init__ stays interpreted code when the module is compiled (core_build.py).


@dataclass(slots=True, init=False)
class OrderRecord:
    order: Order
    # The prefill agent the order went to: (order.prefill_engine_id, order.prefill_rank).
    agent: AgentKey
    state: RankState
    detail: str
    bytes: int
    descriptors: int
    posts: int
    # Adopted from the agent's hello after a failover: an order of an older
    # leader the agent posted. Never sent (the agent holds it), never replayed.
    adopted: bool

    def __init__(
        self,
        order: Order,
        agent: AgentKey,
        state: RankState = RankState.ORDERED,
        detail: str = "",
        bytes: int = 0,
        descriptors: int = 0,
        adopted: bool = False,
    ) -> None:
        self.order, self.agent, self.state = order, agent, state
        self.detail, self.bytes, self.descriptors = detail, bytes, descriptors
        self.posts = 0
        self.adopted = adopted


@dataclass(slots=True, init=False)
class Side:
    """What one engine said about the transfer."""

    engine_id: EngineId
    blocks: BlockGroups
    num_tokens: int

    def __init__(self, engine_id: EngineId, blocks: BlockGroups, num_tokens: int) -> None:
        self.engine_id, self.blocks, self.num_tokens = engine_id, blocks, num_tokens


@dataclass(slots=True, init=False)
class Transfer:
    transfer_id: TransferId
    state: State
    created_mono: float
    created_wall: float
    deadline_mono: float
    updated_wall: float
    reason: Reason
    detail: str
    announced_prefill: EngineId | None
    announced_decode: EngineId | None
    decode: Side | None
    prefill: Side | None
    orders: dict[int, OrderRecord]
    # decode rank -> prefill ranks expected to write into it / already arrived
    expected: dict[int, frozenset[int]]
    arrived: dict[int, frozenset[int]]  # shared sets (orders.shared_ranks)
    # (stage, unix seconds, rank or -1)
    timeline: list[tuple[str, float, int]]
    terminal_mono: float | None
    # Bumped on every deadline change so stale heap entries are ignored.
    deadline_version: int
    # Engines whose in-flight count includes this transfer. At most two: a
    # tuple, which the GC stops tracking once it holds only strings (a set
    # stays tracked: one object more per retained transfer, gcpolicy.py).
    counted: tuple[EngineId, ...]
    # Adopted from agents' hellos after a failover and not ordered by this
    # leader yet (controlplane/adoption.py); and, until then, the prefill
    # ranks each decode rank counted (its hello, its arrival reports).
    adopting: bool
    early_arrivals: dict[int, set[int]]
    # Engines one of whose agents re-sent this transfer in a hello to this
    # leader: only their resubmitted sides are accepted (resubmission.py). A
    # tuple, as `counted`.
    adopted_from: tuple[EngineId, ...]
    # Decode ranks whose hello said the transfer was written in full before
    # the failover (HeldTransfer.ready; all of them: COMPLETE, adoption.py).
    ready_ranks: frozenset[int]

    def __init__(
        self,
        transfer_id: TransferId,
        state: State,
        created_mono: float,
        created_wall: float,
        deadline_mono: float,
        updated_wall: float,
    ) -> None:
        self.transfer_id, self.state = transfer_id, state
        self.created_mono, self.created_wall = created_mono, created_wall
        self.deadline_mono, self.updated_wall = deadline_mono, updated_wall
        self.reason, self.detail = Reason.NONE, ""
        self.announced_prefill = self.announced_decode = None
        self.decode = self.prefill = None
        self.orders, self.expected, self.arrived = {}, {}, {}
        self.timeline = []
        self.terminal_mono = None
        self.deadline_version = 0
        self.counted = ()
        self.adopting = False
        self.early_arrivals = {}
        self.adopted_from = ()
        self.ready_ranks = _NO_RANKS

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

    def arrived_ranks(self) -> set[int]:
        """Prefill ranks whose arrival every decode rank they write into counted
        (a rank whose order has no target, its heads written by another
        replica, has nothing to arrive)."""
        got: set[int] = set()
        for r, o in self.orders.items():
            if not o.order.targets:
                got.add(r)
        missing: set[int] = set()
        for d, exp in self.expected.items():
            seen = self.arrived.get(d)
            for p in exp:
                if seen is not None and p in seen:
                    got.add(p)
                else:
                    missing.add(p)
        return got - missing

    def outstanding_ranks(self) -> list[int]:
        """Prefill ranks whose WRITE is not done or whose arrival is not counted
        by every decode rank it writes into."""
        if not self.orders:
            return []
        arrived = self.arrived_ranks()
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

    def when(self, reported: float, heard: float) -> float:
        """The time to record for an agent's report: the agent's own stamp of
        the event (0: none sent), bounded by the transfer's first event and by
        `heard`, when the report arrived. On one host every clock is the same
        and the bounds never bite; across hosts they keep a skewed clock from
        putting an event before its transfer began or after it was heard."""
        if reported <= 0:
            return heard
        start = self.timeline[0][1] if self.timeline else heard
        return min(max(reported, start), heard)

    def compact(self) -> None:
        """Once the transfer is terminal and no WRITE may land, its orders are
        never sent, replayed or adopted again: drop their targets (a
        WriteTarget and a tuple per rank: two of the five objects each rank
        of a retained transfer holds for a full GC pass, gcpolicy.py). What
        status shows of each rank (order id, state, detail, posts, arrival)
        stays, and a late report still finds its order by id."""
        for rec in self.orders.values():
            o = rec.order
            if o.targets and o.targets is not SETTLED_TARGETS:
                # The constructor, not _replace: this runs for every rank of
                # every transfer that ends, and _replace costs several times more.
                rec.order = Order(
                    o.order_id,
                    o.transfer_id,
                    o.prefill_engine_id,
                    o.prefill_rank,
                    o.prefill_incarnation,
                    SETTLED_TARGETS,
                    o.deadline_unix,
                    o.num_tokens,
                    o.armed,
                )

    def mark(self, stage: str, wall: float, rank: int = -1) -> None:
        self.timeline.append((stage, wall, rank))
        self.updated_wall = wall
