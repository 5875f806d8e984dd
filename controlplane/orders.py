"""WRITE orders: whether a transfer's two engines can exchange KV, the order each
prefill rank gets, which orders each agent incarnation still holds open, and
the arrivals decode ranks report. Plain Python, no gRPC; the rendezvous state
machine decides when."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pushkv.controlplane import order_size
from pushkv.controlplane.domain import (
    AgentKey,
    Effect,
    KVLayout,
    Order,
    OrderId,
    SendCancelOrder,
    SendOrder,
    TransferId,
    WriteTarget,
)
from pushkv.controlplane.errors import InvalidArgument
from pushkv.controlplane.registry import EngineRecord
from pushkv.controlplane.transfer import OrderRecord, Side, Transfer
from pushkv.rules import block_groups
from pushkv.rules.block_groups import BlockGroups
from pushkv.rules.pairing import head_span_units, pair_mismatch
from pushkv.rules.pp_map import region_map
from pushkv.rules.prompt_blocks import prompt_shortfall, prompt_tails
from pushkv.rules.tp_map import prefill_targets, total_heads


def mismatch(t: Transfer, pe: EngineRecord, de: EngineRecord) -> str:
    """Why the prefill engine `pe` cannot write the transfer into decode engine `de`, or "".

    The engines' side of it is pushkv/rules/pairing.py's rule, the one routers apply too."""
    assert t.decode is not None and t.prefill is not None
    problem = pair_mismatch(pe.tp_size, pe.shape, de.tp_size, de.shape)
    if problem:
        return problem
    if t.decode.num_tokens != t.prefill.num_tokens:
        return f"num_tokens: decode {t.decode.num_tokens} != prefill {t.prefill.num_tokens}"
    if len(t.decode.blocks) != len(t.prefill.blocks):
        return "number of KV groups differs"
    if pe.tokens_per_block != de.tokens_per_block:
        # Token ranges (one KV group: pairing refuses more); the prefill side
        # holds every prompt block (admission.side_blocks).
        return ""
    return prompt_shortfall(
        t.prefill.blocks,
        block_groups.lens(t.decode.blocks),
        t.decode.num_tokens,
        de.tokens_per_block,
    )


def arm_problem(t: Transfer, pe: EngineRecord, de: EngineRecord) -> str:
    """Why the transfer's orders cannot be armed on `pe` now that decode
    registered (prefill not done yet), or "": then the order waits for
    prefill done, as without arming, and `mismatch` judges the pair."""
    assert t.decode is not None
    if pair_mismatch(pe.tp_size, pe.shape, de.tp_size, de.shape):
        return "the engines do not pair"
    if pe.tokens_per_block != de.tokens_per_block:
        return "different block sizes: the token ranges need the prefill's blocks"
    if not any(t.decode.blocks):
        return "nothing to write"
    return ""


def source_blocks(prefill: Side, decode: Side, tokens_per_block: int) -> BlockGroups:
    """Per KV group, the prefill blocks written into the decode side's blocks.

    Each side's group is a tail of the prompt's blocks ending at its last block
    (decode: the uncached suffix it holds; prefill: every prompt block, or, in a
    hybrid model's sliding-window group, the window's), so decode's blocks are
    paired with the prefill blocks of the same token positions: the tail of the
    prefill's prompt blocks as long as decode's (`mismatch` checked it fits)."""
    return prompt_tails(
        prefill.blocks, block_groups.lens(decode.blocks), decode.num_tokens, tokens_per_block
    )


def pair_source_blocks(prefill: Side, decode: Side, p_tokens: int, d_tokens: int) -> BlockGroups:
    """Per KV group, the prefill blocks written into the decode side's:
    `source_blocks`, or between blocks of different sizes `resized_source_blocks`."""
    if p_tokens == d_tokens:
        return source_blocks(prefill, decode, d_tokens)
    return resized_source_blocks(prefill, decode, p_tokens, d_tokens)


def token_window(decode: Side, d_tokens: int) -> tuple[int, int]:
    """(first token, end token) of the prompt the decode side's blocks take:
    its blocks cover the prompt's tail, after its local prefix hit (a whole
    number of its blocks), up to its token count. From KV group 0."""
    d_ids = decode.blocks[0] if decode.blocks else ()
    hit = (math.ceil(decode.num_tokens / d_tokens) - len(d_ids)) * d_tokens
    return hit, decode.num_tokens


def resized_source_blocks(prefill: Side, decode: Side, p_tokens: int, d_tokens: int) -> BlockGroups:
    """Per KV group, the prefill blocks holding the tokens the decode side's
    blocks take (different block sizes: `token_window`); empty for a group
    the decode side registered no block in."""
    hit, end = token_window(decode, d_tokens)
    first, last = hit // p_tokens, math.ceil(end / p_tokens)
    # Plain-typed: mypyc iterates no NewType (BlockGroups).
    p_groups: tuple[tuple[int, ...], ...] = prefill.blocks
    d_groups: tuple[tuple[int, ...], ...] = decode.blocks
    return BlockGroups(
        tuple(
            [
                tuple(p_ids[first:last]) if d_ids else ()
                for p_ids, d_ids in zip(p_groups, d_groups, strict=True)
            ]
        )
    )


def resized(
    targets: tuple[WriteTarget, ...],
    decode: Side,
    p_tokens: int,
    d_tokens: int,
    kv_heads: int,
    units: tuple[int, ...],
) -> tuple[WriteTarget, ...]:
    """`targets` (equal TP: whole blocks) as token ranges between blocks of
    `p_tokens` and `d_tokens` tokens (pushkv.proto, WriteTarget)."""
    hit, end = token_window(decode, d_tokens)
    first = hit - hit // p_tokens * p_tokens
    return tuple(
        [
            WriteTarget(
                t.decode_engine_id,
                t.decode_rank,
                t.decode_incarnation,
                t.src_blocks,
                t.dst_blocks,
                t.expected_writers,
                t.slice_offset,
                t.slice_len,
                p_tokens,
                d_tokens,
                first,
                end - hit,
                kv_heads,
                units,
                t.dst_regions,
            )
            for t in targets
        ]
    )


def rank_targets(
    pe: EngineRecord, de: EngineRecord, rank: int, src: BlockGroups, dst: BlockGroups
) -> tuple[WriteTarget, ...]:
    """Where prefill rank `rank` writes (`mismatch` found nothing wrong): the
    decode ranks whose heads it is chosen to write (pushkv/rules/tp_map.py), each
    with its slice and the count of prefill ranks writing into it.

    Equal TP: whole blocks into decode rank `rank`, 1 writer. Prefill TP = k x
    decode TP, disjoint heads: its blocks into decode rank rank // k at slice
    rank % k of each block, k writers. Decode TP = k x prefill TP: slice j of
    each of its blocks into decode rank rank * k + j, 1 writer. Replicated
    heads (and MLA, one latent on every rank): one replica writes each decode
    rank's heads, and a prefill rank no decode rank chose gets no target."""
    p_layout, d_layout = pe.ranks[rank].reg.layout, de.ranks[0].reg.layout
    total = total_heads(
        pe.tp_size,
        p_layout.kv_heads,
        p_layout.compat,
        de.tp_size,
        d_layout.kv_heads,
        d_layout.compat,
    )
    if not total:  # heads not reported: disjoint ranges, in units of the smaller block
        total = max(pe.tp_size, de.tp_size)
    tp_rank = rank % pe.tp_size  # its stage: rank // pe.tp_size
    plan = prefill_targets(
        pe.tp_size,
        p_layout.regions[0].block_len,
        de.tp_size,
        d_layout.regions[0].block_len,
        total,
        tp_rank,
    )
    # Pipeline-parallel prefill (pushkv/rules/pp_map.py): the rank's regions into the
    # decode regions of their layers; every stage writes each decode rank.
    regions = stage_regions(pe.ranks[rank].reg.layout, d_layout) if pe.pp_size > 1 else ()
    return tuple(
        [
            WriteTarget(
                de.engine_id,
                d,
                de.ranks[d].incarnation,
                src,
                dst,
                writers * pe.pp_size,
                offset,
                length,
                dst_regions=regions,
            )
            for d, offset, length, writers in plan
        ]
    )


def stage_regions(p_layout: KVLayout, d_layout: KVLayout) -> tuple[int, ...]:
    """The decode region (of group 0) each group-0 region of a pipeline-parallel
    prefill rank goes into: the same layer's (`mismatch` checked every layer
    pairs)."""
    return region_map(
        [r.layer for r in p_layout.regions if r.group == 0],
        [r.layer for r in d_layout.regions if r.group == 0],
    )


def rank_order(
    order_id: OrderId,
    tid: TransferId,
    decode: Side,
    pe: EngineRecord,
    de: EngineRecord,
    rank: int,
    src: BlockGroups,
    deadline_unix: float,
    armed: bool = False,
) -> Order:
    """The order for prefill rank `rank` of `pe` (armed: `src` is empty)."""
    p_agent = pe.ranks[rank]
    targets = rank_targets(pe, de, rank, src, decode.blocks)
    if pe.tokens_per_block != de.tokens_per_block:
        shape = pe.ranks[0].reg.layout.shape
        units = head_span_units(shape) or ()
        targets = resized(
            targets, decode, pe.tokens_per_block, de.tokens_per_block, shape.kv_heads, units
        )
    return Order(
        order_id=order_id,
        transfer_id=tid,
        prefill_engine_id=pe.engine_id,
        prefill_rank=rank,
        prefill_incarnation=p_agent.incarnation,
        targets=targets,
        deadline_unix=deadline_unix,
        num_tokens=decode.num_tokens,
        armed=armed,
    )


def issue(
    t: Transfer,
    pe: EngineRecord,
    de: EngineRecord,
    src: BlockGroups,
    deadline_unix: float,
    armed: bool,
    next_id: Callable[[], OrderId],
    open_orders: OpenOrders,
    max_bytes: int,
) -> list[Effect]:
    """One order per prefill rank of `pe` (armed: `src` empty), recorded on the
    transfer (its expected writers) and as open for each rank's incarnation.
    Raises OrderTooLarge, recording nothing, if one would pass `max_bytes`."""
    decode = t.decode
    assert decode is not None
    orders = [
        rank_order(next_id(), t.transfer_id, decode, pe, de, rank, src, deadline_unix, armed)
        for rank in range(pe.size)
    ]
    order_size.check(orders, max_bytes)
    effects: list[Effect] = []
    for rank, order in enumerate(orders):
        p_agent = pe.ranks[rank]
        t.orders[rank] = OrderRecord(order, p_agent.key)
        for tgt in order.targets:
            t.expected[tgt.decode_rank] = with_rank(t.expected.get(tgt.decode_rank), rank)
        open_orders.add(p_agent.key, p_agent.incarnation, t.transfer_id, rank)
        effects.append(SendOrder(p_agent.key, p_agent.incarnation, order))
    return effects


# The sets of prefill ranks a decode rank expects, and has seen arrive, are
# few and recur in every transfer between the same TPs ({d} for decode rank d
# between equal TPs): one shared frozenset each, not one per transfer, since
# each object a retained transfer holds is one more for a full GC pass
# (gcpolicy.py).
_RANK_SETS: dict[frozenset[int], frozenset[int]] = {}
_MAX_RANK_SETS = 4096


def shared_ranks(s: frozenset[int]) -> frozenset[int]:
    """The shared frozenset equal to `s` (`s` itself past the bound)."""
    shared = _RANK_SETS.get(s)
    if shared is not None:
        return shared
    if len(_RANK_SETS) < _MAX_RANK_SETS:
        _RANK_SETS[s] = s
    return s


def with_rank(ranks: frozenset[int] | None, rank: int) -> frozenset[int]:
    """`ranks` and `rank`, as the shared frozenset of those ranks."""
    return shared_ranks(ranks | {rank} if ranks is not None else frozenset((rank,)))


def order_by_id(t: Transfer | None, order_id: str) -> OrderRecord | None:
    if t is None:
        return None
    for rec in t.orders.values():
        if rec.order.order_id == order_id:
            return rec
    return None


def record_arrivals(t: Transfer, decode_rank: int, prefill_ranks: Sequence[int]) -> list[int]:
    """Counts the prefill ranks whose WRITE decode rank `decode_rank` saw arrive;
    returns those not counted before, in order. Each must write into that rank."""
    ranks = set(prefill_ranks)
    expected = t.expected.get(decode_rank, frozenset())
    if not ranks <= expected:
        raise InvalidArgument(
            f"ranks {sorted(ranks - expected)} do not write into decode rank {decode_rank}",
            field="arrival.prefill_ranks",
        )
    got = t.arrived.get(decode_rank, frozenset())
    new = ranks - got
    if new:
        t.arrived[decode_rank] = shared_ranks(got | new)
    return sorted(new)


class OpenOrders:
    """Unresolved orders per agent incarnation: (key, incarnation) -> {(transfer, rank)}."""

    def __init__(self) -> None:
        self._by_agent: dict[tuple[AgentKey, str], set[tuple[TransferId, int]]] = {}

    def add(self, key: AgentKey, incarnation: str, tid: TransferId, rank: int) -> None:
        bucket_key = (key, incarnation)
        bucket = self._by_agent.get(bucket_key)
        if bucket is None:
            bucket = self._by_agent[bucket_key] = set()
        bucket.add((tid, rank))

    def close(self, rec: OrderRecord) -> None:
        """The order is resolved: its agent incarnation no longer holds it open."""
        bucket_key = (rec.agent, rec.order.prefill_incarnation)
        bucket = self._by_agent.get(bucket_key)
        if bucket is not None:
            bucket.discard((rec.order.transfer_id, rec.order.prefill_rank))
            if not bucket:
                del self._by_agent[bucket_key]

    def count(self, key: AgentKey, incarnation: str) -> int:
        return len(self._by_agent.get((key, incarnation), ()))

    def of(self, key: AgentKey, incarnation: str) -> list[tuple[TransferId, int]]:
        """The incarnation's open orders, in (transfer, rank) order."""
        return sorted(self._by_agent.get((key, incarnation), ()))

    def replay(
        self, key: AgentKey, incarnation: str, transfers: dict[str, Transfer]
    ) -> list[Effect]:
        """On (re)connect: resend the incarnation's open orders, cancel those
        whose transfer ended; adopted ones are the agent's own (it told us)."""
        out: list[Effect] = []
        for tid, rank in self.of(key, incarnation):
            t = transfers[tid]
            rec = t.orders[rank]
            if rec.adopted:
                continue
            if t.state.terminal:
                out.append(SendCancelOrder(key, incarnation, rec.order.order_id, tid, t.reason))
            else:
                out.append(SendOrder(key, incarnation, rec.order))
        return out

    def pop(self, key: AgentKey, incarnation: str) -> list[tuple[TransferId, int]]:
        """The incarnation's open orders, in (transfer, rank) order, forgotten here."""
        return sorted(self._by_agent.pop((key, incarnation), set()))
