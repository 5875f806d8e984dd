"""pushkv.vllm_integration.compat's block-id helpers (first_group_block_ids, group_block_ids,
held_tail) on vLLM's KVCacheBlocks and on other shapes."""

from __future__ import annotations

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from pushkv.vllm_integration.compat import (
    NULL_BLOCK_ID,
    first_group_block_ids,
    group_block_ids,
    held_tail,
)


def test_slices_group_zero_of_vllms_blocks() -> None:
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in (7, 3, 9, 4, 8)],))
    assert first_group_block_ids(blocks) == (7, 3, 9, 4, 8)
    assert first_group_block_ids(blocks, 1, 4) == (3, 9, 4)
    assert first_group_block_ids(blocks, 2, 99) == (9, 4, 8)
    assert first_group_block_ids(KVCacheBlocks(())) == ()


class _FlatBlocks:
    """Another KVCacheBlocksProtocol: `.blocks` is one flat list, not groups."""

    def __init__(self, ids: list[int]) -> None:
        self.blocks = [KVCacheBlock(i) for i in ids]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([b.block_id for b in self.blocks],)


def test_other_implementations_go_through_get_block_ids() -> None:
    assert first_group_block_ids(_FlatBlocks([5, 6, 7]), 1, 3) == (6, 7)


def test_group_block_ids_drops_the_null_blocks_before_a_window() -> None:
    """vLLM's hybrid KV cache manager: a sliding-window group holds the null
    block (id 0) for every block before its window; each group's ids of a range
    are what it holds, a tail ending at the range's end."""
    null = KVCacheBlock(0)
    null.is_null = True
    full = [KVCacheBlock(i) for i in (7, 3, 9, 4, 8)]
    window = [null, null, KVCacheBlock(11), KVCacheBlock(12), KVCacheBlock(13)]
    blocks = KVCacheBlocks((full, window))
    assert group_block_ids(blocks) == ((7, 3, 9, 4, 8), (11, 12, 13))
    assert group_block_ids(blocks, 1, 4) == ((3, 9, 4), (11, 12))
    assert group_block_ids(blocks, 3, 5) == ((4, 8), (12, 13))
    assert group_block_ids(KVCacheBlocks(([], []))) == ((), ())
    # Another implementation, through get_block_ids.
    assert group_block_ids(_FlatBlocks([0, 0, 6, 7]), 1, 4) == ((6, 7),)


def test_held_tail_keeps_what_follows_the_last_null_block() -> None:
    assert held_tail([5, 6, 7]) == (5, 6, 7)
    assert held_tail([0, 0, 6, 7]) == (6, 7)
    assert held_tail([0, 0]) == ()
    assert held_tail([]) == ()
    assert NULL_BLOCK_ID == 0
