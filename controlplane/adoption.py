"""Adopting transfers after a failover: a new leader rebuilds the live state
from the agents' hellos (pushkv.proto, AgentHello.held). Plain Python, no
gRPC; the rendezvous state machine (rendezvous.py, `agent_hello`) decides when.

The rules (docs/reliability.md, "Failover rebuild"):
- An adopted transfer waits as any other does (AWAITING until its sides come
  back), under the rendezvous deadline, naming the engines whose agents re-sent
  it: if nobody brings its blocks back, it expires and both engines are told.
- A rank a prefill hello reports posted is recorded under its old order id
  (`adopted`: never sent, never replayed); its DONE/FAILED report and the
  decode's arrivals resolve it. It is never ordered again.
- A rank a decode rank counted (its notification came) is written: never
  ordered again either.
- Every other rank is ordered once, with the new leader's term, when both
  sides' blocks are known (`issue_adopted`): one WRITE per rank in all.
- A decode rank that counted every expected writer and told its worker
  KV_READY re-sends the transfer `ready` for a while after. Once every rank of
  the decode engine has (`adopt_ready`), the transfer was written in full
  before the failover: it is COMPLETE here, never ordered, and a side the
  scheduler resubmits is answered COMPLETE (not FAILED: the load may be
  finished while the scheduler's registration is still open).
- A decode rank's replayed arrival may come before any hello names its
  transfer (TP > 1: the decode rank was told and holds nothing; the rank it
  counted freed its blocks). Within the rebuild window it is kept
  (`UnclaimedArrivals`) and counted when the transfer is ordered, if it came
  from a rank of the transfer's decode engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from pushkv.controlplane.domain import (
    AgentKey,
    AgentRegistration,
    Effect,
    EngineId,
    HeldTransfer,
    Order,
    OrderId,
    RankState,
    Role,
    SendOrder,
)
from pushkv.controlplane.orders import OpenOrders, rank_order, shared_ranks, with_rank
from pushkv.controlplane.registry import EngineRecord
from pushkv.controlplane.transfer import OrderRecord, Transfer
from pushkv.rules.block_groups import BlockGroups


def join(
    t: Transfer,
    reg: AgentRegistration,
    h: HeldTransfer,
    deadline_unix: float,
    open_orders: OpenOrders,
) -> bool:
    """Agent `reg` re-sent `h`, a transfer not ended here: it names the agent's
    engine (False, nothing changed, if it names another), its posted order is
    recorded, and a transfer not ordered here yet is adopted (its counted
    ranks kept for when it is)."""
    prefill = reg.role is Role.PREFILL
    named = t.prefill_engine if prefill else t.decode_engine
    if named is not None and named != reg.engine_id:
        return False
    if reg.engine_id not in t.adopted_from:
        t.adopted_from = (*t.adopted_from, reg.engine_id)
    if prefill:
        t.announced_prefill = t.announced_prefill or reg.engine_id
    else:
        t.announced_decode = t.announced_decode or reg.engine_id
    if not t.orders:
        t.adopting = True
    if h.posted:
        adopt_posted(t, reg.key, reg.incarnation, h.posted[0], deadline_unix, open_orders)
    if h.counted and t.adopting:
        adopt_counted(t, reg.key.rank, h.counted)
    return True


def name_engines(t: Transfer, pe: EngineId | None, de: EngineId | None) -> None:
    """A BeginTransfer for an adopted transfer: the engines it announces,
    unless its agents named others (then the call conflicts, as usual)."""
    if t.announced_prefill in (None, pe) and t.announced_decode in (None, de):
        t.announced_prefill, t.announced_decode = pe, de


def adopt_posted(
    t: Transfer,
    key: AgentKey,
    incarnation: str,
    order_id: str,
    deadline_unix: float,
    open_orders: OpenOrders,
) -> bool:
    """Record that prefill rank `key.rank` posted order `order_id` of an older
    leader; False if the transfer already knows a posted or finished order of
    that rank (nothing changes)."""
    rank = key.rank
    rec = t.orders.get(rank)
    oid = OrderId(order_id)
    if rec is not None:
        if rec.order.order_id == oid or rec.adopted or rec.state is not RankState.ORDERED:
            return False
        # This leader's own order for the rank, issued before the agent's first
        # hello here, so never delivered: withdrawn, the posted one stands.
        open_orders.close(rec)
        order = rec.order._replace(order_id=oid, prefill_incarnation=incarnation)
    else:
        order = Order(oid, t.transfer_id, key.engine_id, rank, incarnation, (), deadline_unix, 0)
    t.orders[rank] = OrderRecord(order, key, RankState.POSTED, adopted=True)
    open_orders.add(key, incarnation, t.transfer_id, rank)
    return True


def adopt_counted(t: Transfer, decode_rank: int, prefill_ranks: tuple[int, ...]) -> None:
    """Prefill ranks decode rank `decode_rank` counted before this leader
    ordered the transfer: merged into its arrivals once it does."""
    got = t.early_arrivals.get(decode_rank)
    if got is None:
        got = t.early_arrivals[decode_rank] = set()
    got.update(prefill_ranks)


WHY_WRITTEN = (
    "written before the failover: every decode rank had counted all its writers "
    "and told its worker KV_READY"
)


def adopt_ready(t: Transfer, decode_rank: int, decode_size: int) -> bool:
    """Decode rank `decode_rank` (of an engine of `decode_size` ranks) was told
    KV_READY for adopted transfer `t` before the failover; True once every rank
    of the engine was: all of it was written."""
    t.ready_ranks = t.ready_ranks | {decode_rank}
    return len(t.ready_ranks) >= decode_size


def issue_adopted(
    t: Transfer,
    pe: EngineRecord,
    de: EngineRecord,
    src: BlockGroups,
    deadline_unix: float,
    next_id: Callable[[], OrderId],
    open_orders: OpenOrders,
) -> list[Effect]:
    """The orders of an adopted transfer whose two sides are now known: the
    adopted ranks keep their order (now with its targets, for the arrivals);
    ranks a decode rank counted are DONE, never sent; the others are ordered."""
    assert t.decode is not None
    counted: set[int] = set()
    for ranks in t.early_arrivals.values():
        counted |= ranks
    effects: list[Effect] = []
    for rank in range(pe.size):
        p_agent = pe.ranks[rank]
        rec = t.orders.get(rank)
        oid = rec.order.order_id if rec is not None else next_id()
        order = rank_order(oid, t.transfer_id, t.decode, pe, de, rank, src, deadline_unix)
        for tgt in order.targets:
            t.expected[tgt.decode_rank] = with_rank(t.expected.get(tgt.decode_rank), rank)
        if rec is not None:  # posted before the failover: the agent holds it
            rec.order = order._replace(prefill_incarnation=rec.order.prefill_incarnation)
        elif rank in counted:  # written before the failover
            why = "written before the failover (its notification was counted)"
            t.orders[rank] = OrderRecord(order, p_agent.key, RankState.DONE, why, adopted=True)
        else:
            t.orders[rank] = OrderRecord(order, p_agent.key)
            open_orders.add(p_agent.key, p_agent.incarnation, t.transfer_id, rank)
            effects.append(SendOrder(p_agent.key, p_agent.incarnation, order))
    for d, ranks in t.early_arrivals.items():
        got = ranks & t.expected.get(d, frozenset())
        if got:
            t.arrived[d] = shared_ranks(t.arrived.get(d, frozenset()) | got)
    t.early_arrivals = {}
    t.adopting = False
    return effects


# Replayed arrivals kept for transfers no hello named yet (bounded: the oldest go).
MAX_UNCLAIMED = 100_000


class UnclaimedArrivals:
    """Arrivals a new leader got before it knew their transfer, by transfer id;
    only within the rebuild window (the owner clears them after it)."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, list[tuple[AgentKey, tuple[int, ...]]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, transfer_id: str, key: AgentKey, prefill_ranks: Sequence[int]) -> None:
        got = self._kept.get(transfer_id)
        if got is None:
            got = self._kept[transfer_id] = []
            while len(self._kept) > MAX_UNCLAIMED:
                self._kept.popitem(last=False)
        got.append((key, tuple(prefill_ranks)))

    def claim(self, t: Transfer) -> None:
        """Count the arrivals kept for adopted transfer `t` that came from
        ranks of its decode engine (others' are dropped)."""
        got = self._kept.pop(t.transfer_id, None)
        for key, ranks in got or ():
            if key.engine_id == t.decode_engine:
                adopt_counted(t, key.rank, ranks)

    def clear(self) -> None:
        self._kept.clear()
