"""Whether a prefill engine can push its KV into a decode engine: the one rule.

The coordinator applies it where the two sides meet (controlplane/orders.py,
refusing a transfer FAILED/MISMATCH with the reason), and the router applies it
to the engines ListEngines lists (EngineStatus.kv) before it pairs two of them,
so it never pairs engines the coordinator would refuse. Pure Python on plain
values: no gRPC, no protobuf, typed for mypyc.
"""

from __future__ import annotations

from wire.tp_map import different_tp_mismatch, total_heads


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


# The compat field saying whether an engine's KV cache is MLA latents (vLLM's
# use_mla): checked first, as the clearest reason two layouts cannot pair.
MLA = "mla"


def compat_mismatch(p: tuple[tuple[str, str], ...], d: tuple[tuple[str, str], ...]) -> str:
    """The first compatibility field both engines name and give different values
    (MLA or not first)."""
    p_compat, d_compat = dict(p), dict(d)
    p_mla, d_mla = p_compat.get(MLA), d_compat.get(MLA)
    if p_mla is not None and d_mla is not None and p_mla != d_mla:
        return (
            f"{MLA} differs: prefill {p_mla!r}, decode {d_mla!r} (one engine's KV cache "
            "is MLA latents, the other's per-head K/V: they cannot pair)"
        )
    for name, value in p:
        other = d_compat.get(name)
        if other is not None and other != value:
            return f"{name} differs: prefill {value!r}, decode {other!r}"
    return ""


def tp_mismatch(p_tp: int, p: KVShape, d_tp: int, d: KVShape) -> str:
    """Why KV cannot move between these TP sizes and per-rank layouts, or "".

    Equal TP: every region's blocks are the same size. Different TP: one size
    divides the other, and the heads each rank holds (replicated or MLA
    included) map as wire/tp_map.py says: `different_tp_mismatch`."""
    if len(p.regions) != len(d.regions) or [g for g, _ in p.regions] != [g for g, _ in d.regions]:
        return (
            f"KV regions differ in count or group: prefill {len(p.regions)}, "
            f"decode {len(d.regions)}"
        )
    if p_tp == d_tp:
        if [n for _, n in p.regions] != [n for _, n in d.regions]:
            return "KV regions differ in block length at equal TP"
        return ""
    total = total_heads(p_tp, p.kv_heads, p.compat, d_tp, d.kv_heads, d.compat)
    return different_tp_mismatch(
        p_tp, p.kv_heads, p.head_major, {n for _, n in p.regions},
        d_tp, d.kv_heads, d.head_major, {n for _, n in d.regions},
        total,
    )  # fmt: skip
