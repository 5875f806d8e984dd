"""Which prefill blocks are written into which decode blocks: the rule the
coordinator applies when it knows both sides, and a prefill agent applies when
it fires an armed order (pushkv.proto, TransferOrder.armed)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pushkv.rules.block_groups import BlockGroups


def prompt_tails(
    prefill: Sequence[Sequence[int]],
    dst_lens: Sequence[int],
    num_tokens: int,
    tokens_per_block: int,
) -> BlockGroups:
    """Per KV group, the prefill blocks written into a decode group of
    `dst_lens[g]` blocks (equal block sizes).

    Each side's group is a tail of the prompt's blocks ending at its last
    block (decode: the uncached suffix it holds, after a local prefix hit;
    prefill: every prompt block, or in a sliding-window group the window's),
    so decode's blocks pair with the prefill blocks of the same token
    positions: the tail of the prefill's prompt blocks as long as decode's.
    `prompt_shortfall` says whether the prefill side holds enough."""
    n_prompt_blocks = math.ceil(num_tokens / tokens_per_block)
    src: list[tuple[int, ...]] = []
    for p_ids, n in zip(prefill, dst_lens, strict=True):
        prompt_ids = p_ids[:n_prompt_blocks]
        src.append(tuple(prompt_ids[len(prompt_ids) - n :]) if n else ())
    return BlockGroups(tuple(src))


def prompt_shortfall(
    prefill: Sequence[Sequence[int]],
    dst_lens: Sequence[int],
    num_tokens: int,
    tokens_per_block: int,
) -> str:
    """Why the prefill side cannot fill a decode side of `dst_lens` blocks per
    KV group, or ""."""
    if len(prefill) != len(dst_lens):
        return f"number of KV groups differs: prefill {len(prefill)}, decode {len(dst_lens)}"
    n_prompt_blocks = math.ceil(num_tokens / tokens_per_block)
    for g, (p_ids, n) in enumerate(zip(prefill, dst_lens, strict=True)):
        held = min(len(p_ids), n_prompt_blocks)
        if held < n:
            return (
                f"KV group {g}: prefill holds {held} of the prompt's last blocks, "
                f"decode registered {n}"
            )
    return ""
