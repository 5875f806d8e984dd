"""Messages between the agent's threads. Plain values: no protobuf, no NIXL."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pushkv.agent.nixl_types import BlockResize, KVRegion, MemoryKind
from pushkv.rules.block_groups import BlockGroups


@dataclass(frozen=True, slots=True)
class Target:
    decode_engine_id: str
    decode_rank: int
    decode_incarnation: str
    # Per KV group, the prefill blocks and the decode blocks they are written
    # into (pushkv.proto, WriteTarget.src_blocks/dst_blocks). Armed orders:
    # src is empty until the fire fills it (agent/armed.py).
    src: BlockGroups
    dst: BlockGroups
    expected_writers: int
    # Heterogeneous TP: a head range (pushkv.proto, WriteTarget); 0, 0 = whole blocks.
    slice_offset: int = 0
    slice_len: int = 0
    # Different block sizes: a token range (pushkv.proto, WriteTarget); None = equal sizes.
    resize: BlockResize | None = None
    # Pipeline-parallel prefill: the peer region each local region goes into
    # (pushkv.proto, WriteTarget.dst_regions); () = region i into region i.
    dst_regions: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class OrderMsg:
    order_id: str
    transfer_id: str
    prefill_rank: int
    targets: tuple[Target, ...]
    deadline_unix: float
    error: str = ""  # set when the order cannot be executed as received
    term: int = 0  # the term of the leader that sent it (0: no --etcd)
    num_tokens: int = 0  # the prompt's tokens (checked against the fire's)
    armed: bool = False  # waits for its fire (pushkv.proto, TransferOrder.armed)


@dataclass(frozen=True, slots=True)
class FireMsg:
    """Host (prefill): the request's last prefill forward is done; fire its
    transfer's armed order. `blocks`: per KV group, the blocks the engine holds
    of the prompt (a tail ending at its last block)."""

    transfer_id: str
    blocks: BlockGroups
    num_tokens: int
    # Progressive push (chunked prefill): a chunk's fire, final=False, names
    # the blocks so far and the tokens computed so far; their whole blocks may
    # be written now, without a notification (agent/progressive.py).
    computed_tokens: int = 0
    final: bool = True
    # The request was preempted after a chunk's fire (vLLM freed and recomputed
    # its blocks): the final fire rewrites every block once earlier chunks settled.
    restart: bool = False


@dataclass(frozen=True, slots=True)
class AbortMsg:
    """Host (prefill): these held transfers' requests were aborted after they
    fired: drop orders not yet posted, free the blocks once nothing is in flight."""

    transfer_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CancelMsg:
    order_id: str
    transfer_id: str
    term: int = 0


@dataclass(frozen=True, slots=True)
class TermMsg:
    """A welcome carried a newer leader term: refuse orders and cancels of
    older terms from now on (docs/reliability.md, "Term fencing")."""

    term: int


@dataclass(frozen=True, slots=True)
class PeerMsg:
    engine_id: str
    rank: int
    incarnation: str
    agent_name: str
    metadata: bytes
    regions: tuple[KVRegion, ...]
    memory: MemoryKind


@dataclass(frozen=True, slots=True)
class FencedMsg:
    engine_id: str
    rank: int
    incarnation: str


@dataclass(frozen=True, slots=True)
class NoticeMsg:
    transfer_id: str
    complete: bool
    write_may_land: bool
    detail: str


@dataclass(frozen=True, slots=True)
class ExpectMsg:
    """Host (decode): blocks for these transfers are registered; watch for their WRITEs."""

    transfer_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HoldMsg:
    """Host (prefill): blocks of these transfers are held until BLOCKS_FREE."""

    transfer_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PauseMsg:
    """Host: hold (True) or resume (False) posting new WRITEs (drain/cordon)."""

    paused: bool


@dataclass(frozen=True, slots=True)
class CoordinatorChangedMsg:
    """The link registered with a different coordinator than before (a restart):
    the transfer state held by the old one is gone."""

    lease_s: float


@dataclass(frozen=True, slots=True)
class CoordinatorLostMsg:
    """The link lost its coordinator (the stream ended). Unless that coordinator
    takes the agent back within `give_up_s`, the agent resolves its transfers
    locally: by then no prefill agent can post into them."""

    give_up_s: float
    # A rebuilding agent that follows a leader term (> 0) posts nothing more
    # until a coordinator welcomes it: its snapshot for a newer leader must
    # not miss a WRITE posted after it was taken (agent/snapshot.py).
    hold_posts: bool = False


@dataclass(frozen=True, slots=True)
class CoordinatorAdoptedMsg:
    """A newer leader of the same cluster welcomed the agent (a failover): it
    adopts the agent's transfers from the hello's snapshot. Orders of the old
    term held unposted are refused; held blocks and expectations stay."""


@dataclass(frozen=True, slots=True)
class SnapshotMsg:
    """The link asks for a snapshot of the live transfers (agent/snapshot.py)."""

    gen: int


@dataclass(frozen=True, slots=True)
class CoordinatorBackMsg:
    """The same coordinator took the agent back: it still owns every transfer,
    and what it said of the hello's transfers has been handled."""


@dataclass(frozen=True, slots=True)
class LeaseLapsedMsg:
    """The same coordinator welcomed the agent back after its lease lapsed:
    it counts every order it gave the agent before as resolved (agents never
    post once their lease lapsed), so none held unposted may be posted. Sent
    at the welcome, before any order of the new lease."""


@dataclass(frozen=True, slots=True)
class LeftOutMsg:
    """The hello left these live transfers out (over its bound), and the
    coordinator that welcomed the agent keeps or adopts transfers: it does not
    know them as this agent holds them, and may never tell of their end.
    Sent at the welcome, before any order of the new stream."""

    transfer_ids: tuple[str, ...]


Inbound = (
    OrderMsg
    | CancelMsg
    | PeerMsg
    | FencedMsg
    | NoticeMsg
    | ExpectMsg
    | HoldMsg
    | PauseMsg
    | CoordinatorChangedMsg
    | CoordinatorLostMsg
    | CoordinatorBackMsg
    | LeaseLapsedMsg
    | LeftOutMsg
    | CoordinatorAdoptedMsg
    | SnapshotMsg
    | TermMsg
    | FireMsg
    | AbortMsg
)


class ReportStatus(enum.Enum):
    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"
    DROPPED = "dropped"


@dataclass(frozen=True, slots=True)
class WriteReportMsg:
    order_id: str
    transfer_id: str
    status: ReportStatus
    detail: str = ""
    nbytes: int = 0
    descriptors: int = 0
    posts: int = 0
    # When this status was seen (the agent's wall clock): the report's
    # at_unix_us. Not part of a report's identity.
    at_unix: float = field(default_factory=time.time, compare=False)


@dataclass(frozen=True, slots=True)
class ArrivalMsg:
    transfer_id: str
    prefill_ranks: tuple[int, ...]
    at_unix: float = field(default_factory=time.time, compare=False)


Outbound = WriteReportMsg | ArrivalMsg
