"""vllm_integration.compat.first_group_block_ids on vLLM's KVCacheBlocks and on other shapes."""

from __future__ import annotations

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_integration.compat import first_group_block_ids


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
