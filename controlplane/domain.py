"""Domain types of the coordinator: plain values, no gRPC, no protobuf."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, NewType

from pushkv.rules.block_groups import BlockGroups
from pushkv.rules.pairing import KVShape

TransferId = NewType("TransferId", str)
EngineId = NewType("EngineId", str)
OrderId = NewType("OrderId", str)


# Enum members are singletons compared by identity, so identity hashing is
# equivalent to Enum's hash(name) and runs in C (hot in dict and set lookups).


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    __hash__ = object.__hash__


class FailurePolicy(enum.Enum):
    """An engine's on_transfer_failure, carried from its hello to ListEngines
    (the coordinator only publishes it; routers act on it)."""

    UNSTATED = "unstated"  # read as RECOMPUTE, the connector's default
    RECOMPUTE = "recompute"
    FAIL = "fail"

    __hash__ = object.__hash__


class State(enum.Enum):
    AWAITING = "awaiting"
    REGISTERED = "registered"
    PREFILL_DONE = "prefill_done"
    # Decode registered before prefill finished: the prefill engine's agents
    # hold armed orders and fire them at its last prefill forward.
    ARMED = "armed"
    ORDERED = "ordered"
    WRITING = "writing"
    COMPLETE = "complete"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    __hash__ = object.__hash__
    # Set on each member below: a plain attribute, read many times per change.
    terminal: bool


_TERMINAL = frozenset({State.COMPLETE, State.FAILED, State.CANCELLED, State.EXPIRED})
# Ordered or armed, not ended: a lost agent of either engine fails these.
MOVING = (State.ARMED, State.ORDERED, State.WRITING)
for _st in State:
    _st.terminal = _st in _TERMINAL


class Reason(enum.Enum):
    NONE = "none"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    WRITE_FAILED = "write_failed"
    AGENT_LOST = "agent_lost"
    AGENT_FENCED = "agent_fenced"
    MISMATCH = "mismatch"
    NOTHING_TO_WRITE = "nothing_to_write"
    PREFILL_ABORTED = "prefill_aborted"
    TOO_LARGE = "too_large"

    __hash__ = object.__hash__


class RankState(enum.Enum):
    ORDERED = "ordered"
    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"
    DROPPED = "dropped"

    __hash__ = object.__hash__
    # True once no WRITE of this order can still land (set on each member below).
    resolved: bool


_RESOLVED = frozenset({RankState.DONE, RankState.FAILED, RankState.DROPPED})
for _rs in RankState:
    _rs.resolved = _rs in _RESOLVED


class WriteStatus(enum.Enum):
    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"
    DROPPED = "dropped"

    __hash__ = object.__hash__


class AgentKey(NamedTuple):
    """A tuple: hashed and compared in C (a key of several hot dicts)."""

    engine_id: EngineId
    rank: int

    def __str__(self) -> str:
        return f"{self.engine_id}/{self.rank}"


@dataclass(frozen=True, slots=True)
class KVRegion:
    base_addr: int
    block_len: int
    num_blocks: int
    device_id: int = 0
    group: int = 0
    name: str = ""
    layer: int = -1  # the model layer it holds (KVRegion.layer); -1 = not reported


@dataclass(frozen=True, slots=True)
class KVLayout:
    tokens_per_block: int
    regions: tuple[KVRegion, ...]
    memory_kind: str = "DRAM"
    compat_hash: str = ""
    # (name, value) pairs both engines must agree on besides TP, sorted by name.
    compat: tuple[tuple[str, str], ...] = ()
    kv_heads: int = 0  # KV heads this rank holds per block; 0 = unknown
    head_major: bool = False  # a head range of a block is one contiguous span
    # Derived once: read by every registration and prefill report.
    num_blocks: int = field(init=False, repr=False, compare=False)
    num_groups: int = field(init=False, repr=False, compare=False)
    # What the pairing rule (pushkv/rules/pairing.py) reads, for each transfer's pairing.
    shape: KVShape = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_blocks", min((r.num_blocks for r in self.regions), default=0))
        object.__setattr__(self, "num_groups", max((r.group for r in self.regions), default=-1) + 1)
        shape = KVShape(
            self.tokens_per_block,
            compat=self.compat,
            compat_hash=self.compat_hash,
            kv_heads=self.kv_heads,
            head_major=self.head_major,
            regions=tuple([(r.group, r.block_len) for r in self.regions]),
            layers=tuple([r.layer for r in self.regions]),
        )
        object.__setattr__(self, "shape", shape)


@dataclass(frozen=True, slots=True)
class AgentRegistration:
    engine_id: EngineId
    role: Role
    tp_rank: int
    tp_size: int
    incarnation: str
    nixl_agent_name: str
    nixl_metadata: bytes
    layout: KVLayout
    api_url: str = ""
    # Pipeline-parallel stage and stage count: the engine's rank number (the
    # key's) is pp_rank * tp_size + tp_rank.
    pp_rank: int = 0
    pp_size: int = 1
    # Routers dispatch to this engine: api_url is required (admission.check_hello).
    routable: bool = False
    on_transfer_failure: FailurePolicy = FailurePolicy.UNSTATED
    # Derived once: read several times per report on the hot path.
    key: AgentKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rank = self.pp_rank * self.tp_size + self.tp_rank
        object.__setattr__(self, "key", AgentKey(self.engine_id, rank))


# Orders are immutable tuples: one built per prefill rank of every transfer,
# and a NamedTuple builds in one call where a frozen dataclass sets each field.
class WriteTarget(NamedTuple):
    decode_engine_id: EngineId
    decode_rank: int
    decode_incarnation: str
    src_blocks: BlockGroups  # per KV group, in the order of the prompt
    dst_blocks: BlockGroups
    expected_writers: int
    slice_offset: int = 0
    slice_len: int = 0
    # Different block sizes (pushkv.proto, WriteTarget); all 0 = equal sizes.
    src_tokens_per_block: int = 0
    dst_tokens_per_block: int = 0
    first_token: int = 0
    resize_tokens: int = 0
    kv_heads: int = 0
    head_span_units: tuple[int, ...] = ()
    # Pipeline-parallel prefill: the decode region each source region goes
    # into (pushkv.proto, WriteTarget.dst_regions); () = region i into region i.
    dst_regions: tuple[int, ...] = ()


class Order(NamedTuple):
    order_id: OrderId
    transfer_id: TransferId
    prefill_engine_id: EngineId
    prefill_rank: int
    prefill_incarnation: str
    targets: tuple[WriteTarget, ...]
    deadline_unix: float
    num_tokens: int
    # Armed (pushkv.proto, TransferOrder.armed): the targets' src_blocks are
    # empty; the prefill agent fills them from its request when it fires.
    armed: bool = False


class HeldTransfer(NamedTuple):
    """One live transfer an agent re-sent in its hello (pushkv.proto,
    HeldTransfer): a new leader adopts it (controlplane/adoption.py)."""

    transfer_id: str
    posted: tuple[str, ...] = ()  # prefill: order ids posted (never ordered again)
    unposted: tuple[str, ...] = ()  # prefill: order ids held unposted (the agent refuses them)
    counted: tuple[int, ...] = ()  # decode: prefill ranks whose notification it counted
    ready: bool = False  # decode: it counted them all and told KV_READY (written)


@dataclass(frozen=True, slots=True)
class Notice:
    """A transfer state that the hosts of both engines must act on."""

    transfer_id: TransferId
    state: State
    reason: Reason
    detail: str
    write_may_land: bool


# ------------------------------------------------------------------ effects
# The core returns these; the transport delivers them. Transient, so not
# frozen: a frozen dataclass costs a setattr call per field to build.


@dataclass(slots=True, init=False)
class SendOrder:
    to: AgentKey
    incarnation: str
    order: Order

    # Written out: a dataclass-made __init__ stays interpreted when compiled.
    def __init__(self, to: AgentKey, incarnation: str, order: Order) -> None:
        self.to, self.incarnation, self.order = to, incarnation, order


@dataclass(slots=True)
class SendCancelOrder:
    to: AgentKey
    incarnation: str
    order_id: OrderId
    transfer_id: TransferId
    reason: Reason


@dataclass(slots=True)
class SendNotice:
    to: AgentKey
    incarnation: str
    notice: Notice


@dataclass(slots=True)
class SendPeerFenced:
    to: AgentKey
    incarnation: str
    peer: AgentKey
    peer_incarnation: str


@dataclass(slots=True, init=False)
class TransferChanged:
    transfer_id: TransferId

    def __init__(self, transfer_id: TransferId) -> None:
        self.transfer_id = transfer_id


@dataclass(slots=True)
class AgentNotBack:
    """An agent whose stream closed did not say hello again within the
    reconnect grace: its engine is not ready, and its moving transfers failed
    unless they wait for its lease (`transfers_failed` 0: a node relay's
    stream lost, or no fail_on_disconnect). A line for the operator; the
    TransferChanged effects carry the failures."""

    key: AgentKey
    incarnation: str
    transfers_failed: int


Effect = SendOrder | SendCancelOrder | SendNotice | SendPeerFenced | TransferChanged | AgentNotBack
