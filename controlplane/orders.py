"""WRITE orders: whether a transfer's two engines can exchange KV, the order each
prefill rank gets, which orders each agent incarnation still holds open, and
the arrivals decode ranks report. Plain Python, no gRPC; the rendezvous state
machine decides when."""

from __future__ import annotations

import math
from collections.abc import Sequence

from controlplane.domain import (
    AgentKey,
    Blocks,
    KVLayout,
    Order,
    OrderId,
    TransferId,
    WriteTarget,
)
from controlplane.errors import InvalidArgument
from controlplane.registry import EngineRecord
from controlplane.transfer import OrderRecord, Side, Transfer


def mismatch(t: Transfer, pe: EngineRecord, de: EngineRecord) -> str:
    """Why the prefill engine `pe` cannot write the transfer into decode engine `de`, or ""."""
    assert t.decode is not None and t.prefill is not None
    p_layout = pe.ranks[0].reg.layout
    d_layout = de.ranks[0].reg.layout
    problem = compat_mismatch(p_layout, d_layout)
    if problem:
        return problem
    if pe.tokens_per_block != de.tokens_per_block:
        return f"tokens per block differ: {pe.tokens_per_block} vs {de.tokens_per_block}"
    if pe.compat_hash and de.compat_hash and pe.compat_hash != de.compat_hash:
        return "KV layouts are incompatible (compat_hash differs)"
    if t.decode.num_tokens != t.prefill.num_tokens:
        return f"num_tokens: decode {t.decode.num_tokens} != prefill {t.prefill.num_tokens}"
    if len(t.decode.blocks) != len(t.prefill.blocks):
        return "number of KV groups differs"
    return tp_mismatch(pe.tp_size, p_layout, de.tp_size, d_layout)


def compat_mismatch(p: KVLayout, d: KVLayout) -> str:
    """The first compatibility field both engines name and give different values."""
    d_compat = dict(d.compat)
    for name, value in p.compat:
        other = d_compat.get(name)
        if other is not None and other != value:
            return f"{name} differs: prefill {value!r}, decode {other!r}"
    return ""


def tp_mismatch(p_tp: int, p: KVLayout, d_tp: int, d: KVLayout) -> str:
    """Why KV cannot move between these TP sizes and per-rank layouts, or "".

    Equal TP: every region's blocks are the same size. Different TP: one size
    divides the other and each rank holds its own head range (no replicated
    heads, no MLA), so the larger side's block is `ratio` smaller blocks one
    after another; both sides head-major, one block length in every region."""
    if len(p.regions) != len(d.regions) or [r.group for r in p.regions] != [
        r.group for r in d.regions
    ]:
        return (
            f"KV regions differ in count or group: prefill {len(p.regions)}, "
            f"decode {len(d.regions)}"
        )
    if p_tp == d_tp:
        if [r.block_len for r in p.regions] != [r.block_len for r in d.regions]:
            return "KV regions differ in block length at equal TP"
        return ""
    what = f"prefill TP {p_tp} into decode TP {d_tp}"
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        return f"{what}: one TP size must divide the other"
    if not (p.head_major and d.head_major):
        return (
            f"{what}: needs a head-major KV block layout on both sides (a head range "
            f"of a block contiguous); prefill head_major={p.head_major}, "
            f"decode head_major={d.head_major}"
        )
    if p.kv_heads and d.kv_heads and p.kv_heads * p_tp != d.kv_heads * d_tp:
        return (
            f"{what}: KV heads are replicated across ranks (prefill {p.kv_heads} per rank, "
            f"decode {d.kv_heads} per rank): TP larger than the KV heads, or MLA, "
            "is not supported with different TP sizes"
        )
    p_len, d_len = {r.block_len for r in p.regions}, {r.block_len for r in d.regions}
    if len(p_len) != 1 or len(d_len) != 1:
        return f"{what}: needs one block length in every KV region"
    small, large = (p_len.pop(), d_len.pop()) if p_tp > d_tp else (d_len.pop(), p_len.pop())
    ratio = max(p_tp, d_tp) // min(p_tp, d_tp)
    if large != ratio * small:
        return (
            f"{what}: block length {large} is not {ratio} x {small}: the ranks do not "
            "hold disjoint head ranges (replicated heads or MLA)"
        )
    return ""


def source_blocks(prefill: Side, decode: Side, tokens_per_block: int) -> Blocks:
    """Per KV group, the prefill blocks written into the decode side's blocks."""
    n_prompt_blocks = math.ceil(decode.num_tokens / tokens_per_block)
    src: list[tuple[int, ...]] = []
    for p_ids, d_ids in zip(prefill.blocks, decode.blocks, strict=True):
        prompt_ids = p_ids[:n_prompt_blocks]
        # A decode prefix hit registers only the tail: write the matching tail.
        src.append(prompt_ids[len(prompt_ids) - len(d_ids) :] if d_ids else ())
    return tuple(src)


def rank_targets(
    pe: EngineRecord, de: EngineRecord, rank: int, src: Blocks, dst: Blocks
) -> tuple[WriteTarget, ...]:
    """Where prefill rank `rank` writes (`mismatch` found nothing wrong).

    Equal TP: whole blocks into decode rank `rank`. Prefill TP = k x decode TP:
    its blocks into decode rank rank // k at slice rank % k of each block, and
    that decode rank expects k writers. Decode TP = k x prefill TP: slice j of
    each of its blocks into decode rank rank * k + j, which expects 1 writer."""
    p_tp, d_tp = pe.tp_size, de.tp_size
    if p_tp == d_tp:
        d = de.ranks[rank]
        return (WriteTarget(de.engine_id, rank, d.incarnation, src, dst, 1),)
    if p_tp > d_tp:
        k = p_tp // d_tp
        n = pe.ranks[rank].reg.layout.regions[0].block_len
        d = de.ranks[rank // k]
        return (
            WriteTarget(de.engine_id, rank // k, d.incarnation, src, dst, k, (rank % k) * n, n),
        )
    k = d_tp // p_tp
    targets = []
    for j in range(k):
        d = de.ranks[rank * k + j]
        n = d.reg.layout.regions[0].block_len
        targets.append(
            WriteTarget(de.engine_id, rank * k + j, d.incarnation, src, dst, 1, j * n, n)
        )
    return tuple(targets)


def rank_order(
    order_id: OrderId,
    tid: TransferId,
    decode: Side,
    pe: EngineRecord,
    de: EngineRecord,
    rank: int,
    src: Blocks,
    deadline_unix: float,
) -> Order:
    """The order for prefill rank `rank` of `pe`."""
    p_agent = pe.ranks[rank]
    return Order(
        order_id=order_id,
        transfer_id=tid,
        prefill_engine_id=pe.engine_id,
        prefill_rank=rank,
        prefill_incarnation=p_agent.incarnation,
        targets=rank_targets(pe, de, rank, src, decode.blocks),
        deadline_unix=deadline_unix,
        num_tokens=decode.num_tokens,
    )


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
    got = t.arrived.get(decode_rank)
    if got is None:
        got = t.arrived[decode_rank] = set()
    new = ranks - got
    got.update(new)
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

    def pop(self, key: AgentKey, incarnation: str) -> list[tuple[TransferId, int]]:
        """The incarnation's open orders, in (transfer, rank) order, forgotten here."""
        return sorted(self._by_agent.pop((key, incarnation), set()))
