"""pushkv.vllm_integration.compat's block-id helpers, where vLLM's block ids
become BlockGroups (single_group, all_groups, held_groups, held_tail), on
vLLM's KVCacheBlocks and on other shapes."""

from __future__ import annotations

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from pushkv.vllm_integration.compat import (
    NULL_BLOCK_ID,
    all_groups,
    held_groups,
    held_tail,
    single_group,
)


def test_slices_group_zero_of_vllms_blocks() -> None:
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in (7, 3, 9, 4, 8)],))
    assert single_group(blocks) == ((7, 3, 9, 4, 8),)
    assert single_group(blocks, 1, 4) == ((3, 9, 4),)
    assert single_group(blocks, 2, 99) == ((9, 4, 8),)
    assert single_group(KVCacheBlocks(())) == ((),)


class _FlatBlocks:
    """Another KVCacheBlocksProtocol: `.blocks` is one flat list, not groups."""

    def __init__(self, ids: list[int]) -> None:
        self.blocks = [KVCacheBlock(i) for i in ids]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([b.block_id for b in self.blocks],)


def test_other_implementations_go_through_get_block_ids() -> None:
    assert single_group(_FlatBlocks([5, 6, 7]), 1, 3) == ((6, 7),)


def test_all_groups_drops_the_null_blocks_before_a_window() -> None:
    """vLLM's hybrid KV cache manager: a sliding-window group holds the null
    block (id 0) for every block before its window; each group's ids of a range
    are what it holds, a tail ending at the range's end."""
    null = KVCacheBlock(0)
    null.is_null = True
    full = [KVCacheBlock(i) for i in (7, 3, 9, 4, 8)]
    window = [null, null, KVCacheBlock(11), KVCacheBlock(12), KVCacheBlock(13)]
    blocks = KVCacheBlocks((full, window))
    assert all_groups(blocks) == ((7, 3, 9, 4, 8), (11, 12, 13))
    assert all_groups(blocks, 1, 4) == ((3, 9, 4), (11, 12))
    assert all_groups(blocks, 3, 5) == ((4, 8), (12, 13))
    assert all_groups(KVCacheBlocks(([], []))) == ((), ())
    # Another implementation, through get_block_ids.
    assert all_groups(_FlatBlocks([0, 0, 6, 7]), 1, 4) == ((6, 7),)


def test_held_groups_keep_every_block_of_one_group_and_the_window_of_several() -> None:
    """vLLM's per-group id lists (request_finished_all_groups, the scheduler
    output): one group as it is; with several, each group's blocks of the
    prompt after its null blocks."""
    assert held_groups(([5, 6, 7, 8],), 40, 16) == ((5, 6, 7, 8),)  # one group: untrimmed
    assert held_groups(([5, 6, 7, 8], [0, 0, 11, 12]), 40, 16) == ((5, 6, 7), (11,))
    assert held_groups(([5, 6], [0, 9]), 32, 16) == ((5, 6), (9,))


def test_held_tail_keeps_what_follows_the_last_null_block() -> None:
    assert held_tail([5, 6, 7]) == (5, 6, 7)
    assert held_tail([0, 0, 6, 7]) == (6, 7)
    assert held_tail([0, 0]) == ()
    assert held_tail([]) == ()
    assert NULL_BLOCK_ID == 0
