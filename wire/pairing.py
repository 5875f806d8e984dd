"""Whether a prefill engine can push its KV into a decode engine: the one rule.

The coordinator applies it where the two sides meet (controlplane/orders.py,
refusing a transfer FAILED/MISMATCH with the reason), and the router applies it
to the engines ListEngines lists (EngineStatus.kv) before it pairs two of them,
so it never pairs engines the coordinator would refuse. Pure Python on plain
values: no gRPC, no protobuf, typed for mypyc.
"""

from __future__ import annotations


class KVShape:
    """What pairing reads of one engine besides its TP size: its first rank's KV
    layout, without addresses. The coordinator derives it once per registered
    layout; a router builds it from EngineStatus.kv."""

    __slots__ = (
        "compat",
        "compat_hash",
        "head_major",
        "kv_heads",
        "regions",
        "tokens_per_block",
    )

    def __init__(
        self,
        tokens_per_block: int,
        *,
        compat: tuple[tuple[str, str], ...] = (),
        compat_hash: str = "",
        kv_heads: int = 0,
        head_major: bool = False,
        regions: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.tokens_per_block = tokens_per_block
        self.compat = compat  # (name, value) pairs both sides must agree on
        self.compat_hash = compat_hash
        self.kv_heads = kv_heads  # KV heads one rank holds per block; 0 = unknown
        self.head_major = head_major  # a head range of a block is one contiguous span
        self.regions = regions  # (KV group, block length in bytes) per region


def pair_mismatch(p_tp: int, p: KVShape, d_tp: int, d: KVShape) -> str:
    """Why a prefill engine of TP `p_tp` and shape `p` cannot write into a decode
    engine of TP `d_tp` and shape `d`, or "".

    Everything but the TP sizes must agree; the TP sizes must pass `tp_mismatch`."""
    problem = compat_mismatch(p.compat, d.compat)
    if problem:
        return problem
    if p.tokens_per_block != d.tokens_per_block:
        return f"tokens per block differ: {p.tokens_per_block} vs {d.tokens_per_block}"
    if p.compat_hash and d.compat_hash and p.compat_hash != d.compat_hash:
        return "KV layouts are incompatible (compat_hash differs)"
    return tp_mismatch(p_tp, p, d_tp, d)


def compat_mismatch(p: tuple[tuple[str, str], ...], d: tuple[tuple[str, str], ...]) -> str:
    """The first compatibility field both engines name and give different values."""
    d_compat = dict(d)
    for name, value in p:
        other = d_compat.get(name)
        if other is not None and other != value:
            return f"{name} differs: prefill {value!r}, decode {other!r}"
    return ""


def tp_mismatch(p_tp: int, p: KVShape, d_tp: int, d: KVShape) -> str:
    """Why KV cannot move between these TP sizes and per-rank layouts, or "".

    Equal TP: every region's blocks are the same size. Different TP: one size
    divides the other and each rank holds its own head range (no replicated
    heads, no MLA), so the larger side's block is `ratio` smaller blocks one
    after another; both sides head-major, one block length in every region."""
    if len(p.regions) != len(d.regions) or [g for g, _ in p.regions] != [g for g, _ in d.regions]:
        return (
            f"KV regions differ in count or group: prefill {len(p.regions)}, "
            f"decode {len(d.regions)}"
        )
    if p_tp == d_tp:
        if [n for _, n in p.regions] != [n for _, n in d.regions]:
            return "KV regions differ in block length at equal TP"
        return ""
    what = f"prefill TP {p_tp} into decode TP {d_tp}"
    if min(p_tp, d_tp) < 1 or max(p_tp, d_tp) % min(p_tp, d_tp):
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
    p_len = {n for _, n in p.regions}
    d_len = {n for _, n in d.regions}
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
