"""Which prefill rank writes which KV heads into which decode rank, for any two
TP sizes where one divides the other, replicated KV heads and MLA included.

vLLM shards a model's H KV heads over TP ranks: with TP <= H rank r holds the
H / TP heads [r * H / TP, (r + 1) * H / TP); with TP > H each head is
replicated on TP / H consecutive ranks (rank r holds head r // (TP / H)). MLA
is the case H = 1: its one latent vector per token is on every rank.

Each decode rank must get every head it holds exactly once: for each of its
heads one prefill rank holding that head writes it (of several replicas, the
one numbered `decode rank mod replicas`, so that replicas share the work). A
prefill rank chosen by no decode rank writes nothing (its order has no
targets); each decode rank expects exactly the distinct prefill ranks chosen
for its heads. Equal TP maps rank r onto rank r, whole blocks, as always.

One side's head range always contains the other's (one TP size divides the
other), so each (prefill rank, decode rank) pair moves one contiguous head
range: whole blocks when both hold the same heads, else a slice of the larger
block (`slice_offset`, `slice_len` bytes) against whole blocks of the smaller.
Pure Python on plain values, typed for mypyc.
"""

from __future__ import annotations

TOTAL_KV_HEADS = "total_kv_heads"  # the compat field naming the model's KV heads


def rank_heads(tp: int, total: int, rank: int) -> tuple[int, int]:
    """The heads [first, end) that rank `rank` of a TP `tp` engine holds."""
    if tp <= total:
        per = total // tp
        return rank * per, rank * per + per
    head = rank // (tp // total)
    return head, head + 1


def heads_per_rank(tp: int, total: int) -> int:
    return total // tp if tp <= total else 1


def shard_mismatch(side: str, tp: int, per_rank: int, total: int) -> str:
    """Why `per_rank` heads per rank at TP `tp` is not how vLLM shards `total`, or ""."""
    if tp <= total and total % tp:
        return f"{side} TP {tp} does not divide the {total} KV heads"
    if tp > total and tp % total:
        return f"{side} TP {tp} is not a multiple of the {total} KV heads"
    if per_rank != heads_per_rank(tp, total):
        return (
            f"{side} reports {per_rank} KV heads per rank; TP {tp} of {total} KV heads "
            f"gives {heads_per_rank(tp, total)}"
        )
    return ""


def total_heads(
    p_tp: int, p_heads: int, p_compat: tuple[tuple[str, str], ...],
    d_tp: int, d_heads: int, d_compat: tuple[tuple[str, str], ...],
) -> int:  # fmt: skip
    """The model's KV heads: the `total_kv_heads` compat field either side names,
    else, when both sides hold disjoint head ranges as far as their per-rank
    counts tell, their product with TP; 0 when unknown (replicated heads on
    some side and no total reported)."""
    for compat in (p_compat, d_compat):
        for name, value in compat:
            if name == TOTAL_KV_HEADS and value.isdigit() and int(value) > 0:
                return int(value)
    if p_heads and p_heads * p_tp == d_heads * d_tp:
        return p_heads * p_tp
    return 0


def decode_sources(p_tp: int, d_tp: int, total: int, d_rank: int) -> list[tuple[int, int, int]]:
    """(prefill rank, first head, end head) writing each head range of decode
    rank `d_rank`, in head order; one entry per prefill rank."""
    first, end = rank_heads(d_tp, total, d_rank)
    out: list[tuple[int, int, int]] = []
    for h in range(first, end):
        if p_tp <= total:
            src = h // (total // p_tp)
        else:
            replicas = p_tp // total
            src = h * replicas + d_rank % replicas
        if out and out[-1][0] == src and out[-1][2] == h:
            out[-1] = (src, out[-1][1], h + 1)
        else:
            out.append((src, h, h + 1))
    return out


def prefill_targets(
    p_tp: int, p_block_len: int, d_tp: int, d_block_len: int, total: int, p_rank: int
) -> list[tuple[int, int, int, int]]:
    """Where prefill rank `p_rank` writes: (decode rank, slice offset, slice
    length, expected writers) per decode rank; slice length 0 = whole blocks.
    Empty when every decode rank takes its heads from other replicas."""
    if p_tp == d_tp:
        return [(p_rank, 0, 0, 1)]
    p_per, d_per = heads_per_rank(p_tp, total), heads_per_rank(d_tp, total)
    head_len = p_block_len // p_per
    p_first = rank_heads(p_tp, total, p_rank)[0]
    out: list[tuple[int, int, int, int]] = []
    for d in range(d_tp):
        sources = decode_sources(p_tp, d_tp, total, d)
        d_first = rank_heads(d_tp, total, d)[0]
        for src, first, _end in sources:
            if src != p_rank:
                continue
            if p_per == d_per:
                out.append((d, 0, 0, len(sources)))
            elif p_per > d_per:  # a head range of the prefill block
                out.append((d, (first - p_first) * head_len, d_block_len, len(sources)))
            else:  # into a head range of the decode block
                out.append((d, (first - d_first) * head_len, p_block_len, len(sources)))
    return out


def different_tp_mismatch(
    p_tp: int, p_heads: int, p_head_major: bool, p_lens: set[int],
    d_tp: int, d_heads: int, d_head_major: bool, d_lens: set[int],
    total: int,
) -> str:  # fmt: skip
    """Why KV cannot move from prefill TP `p_tp` into decode TP `d_tp` (they
    differ) with these per-rank heads and block lengths and `total` KV heads
    (0: unknown), or ""."""
    what = f"prefill TP {p_tp} into decode TP {d_tp}"
    if min(p_tp, d_tp) < 1 or max(p_tp, d_tp) % min(p_tp, d_tp):
        return f"{what}: one TP size must divide the other"
    if not (p_heads and d_heads):  # not reported: the block lengths must tell
        return _unknown_heads_mismatch(what, p_tp, p_head_major, p_lens, d_tp, d_head_major, d_lens)
    if not total:
        return (
            f"{what}: KV heads are replicated across ranks (prefill {p_heads} per rank, "
            f"decode {d_heads} per rank) and neither engine reports {TOTAL_KV_HEADS}, "
            "so which rank holds which head is unknown"
        )
    if len(p_lens) != 1 or len(d_lens) != 1:
        return f"{what}: needs one block length in every KV region"
    for problem in (
        shard_mismatch("prefill", p_tp, p_heads, total),
        shard_mismatch("decode", d_tp, d_heads, total),
    ):
        if problem:
            return f"{what}: {problem}"
    p_len, d_len = min(p_lens), min(d_lens)
    if p_len % p_heads or d_len % d_heads or p_len // p_heads != d_len // d_heads:
        return (
            f"{what}: a KV head is not the same size on both sides (prefill block "
            f"{p_len} B / {p_heads} heads, decode block {d_len} B / {d_heads} heads)"
        )
    if p_heads != d_heads and not (p_head_major and d_head_major):
        return (
            f"{what}: needs a head-major KV block layout on both sides (a head range "
            f"of a block contiguous); prefill head_major={p_head_major}, "
            f"decode head_major={d_head_major}"
        )
    return ""


def _unknown_heads_mismatch(
    what: str, p_tp: int, p_head_major: bool, p_lens: set[int],
    d_tp: int, d_head_major: bool, d_lens: set[int],
) -> str:  # fmt: skip
    """An engine that does not report its heads per rank: each rank must hold
    a disjoint head range, so the larger side's block is `ratio` smaller ones
    (`prefill_targets` then maps it with `max(p_tp, d_tp)` unit heads)."""
    if not (p_head_major and d_head_major):
        return (
            f"{what}: needs a head-major KV block layout on both sides (a head range "
            f"of a block contiguous); prefill head_major={p_head_major}, "
            f"decode head_major={d_head_major}"
        )
    if len(p_lens) != 1 or len(d_lens) != 1:
        return f"{what}: needs one block length in every KV region"
    p_len, d_len = min(p_lens), min(d_lens)
    small, large = (p_len, d_len) if p_tp > d_tp else (d_len, p_len)
    ratio = max(p_tp, d_tp) // min(p_tp, d_tp)
    if large != ratio * small:
        return (
            f"{what}: block length {large} is not {ratio} x {small}: the ranks do not "
            "hold disjoint head ranges (replicated heads or MLA) and the engines do not "
            "report their KV heads"
        )
    return ""
