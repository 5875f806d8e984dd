"""A trivial scheduler-side KV connector for harness tests against the real vLLM Scheduler.

It behaves like a (much simplified) NIXL consumer: a request whose
``kv_transfer_params`` carry ``do_remote_prefill: true`` is loaded
asynchronously in full (minus any local prefix-cache hit); the flag is then
cleared, so a retry after a failed load recomputes locally.  Every hook call
is recorded in ``calls`` so tests can assert on exactly what vLLM passed in.

Loaded through ``kv_connector_module_path="tests.support.toy_connector"``.  The worker
half is a no-op: harness tests feed ``KVConnectorOutput`` by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class ToyLoad:
    request_id: str
    block_ids: list[int]  # the uncached suffix the connector must fill
    num_external_tokens: int


@dataclass
class ToyConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    loads: list[ToyLoad] = field(default_factory=list)


@dataclass
class ToyCall:
    method: str
    request_id: str | None
    args: dict[str, Any]


class ToyConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM is untyped here
    """Records every scheduler-side hook call; loads remote-prefill requests async."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: list[ToyCall] = []
        self.pending_loads: list[ToyLoad] = []
        # request_finished's first return value; tests flip it per scenario.
        self.delay_free_on_finish = False

    def calls_to(self, method: str) -> list[ToyCall]:
        return [c for c in self.calls if c.method == method]

    # ---- scheduler side -------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        num_external = 0
        if params.get("do_remote_prefill"):
            num_external = request.num_prompt_tokens - num_computed_tokens
        self.calls.append(
            ToyCall(
                "get_num_new_matched_tokens",
                request.request_id,
                {"num_computed_tokens": num_computed_tokens, "returned": num_external},
            )
        )
        return num_external, num_external > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        unhashed = blocks.get_unhashed_block_ids()
        self.calls.append(
            ToyCall(
                "update_state_after_alloc",
                request.request_id,
                {
                    "num_external_tokens": num_external_tokens,
                    "block_ids": blocks.get_block_ids()[0],
                    "unhashed_block_ids": unhashed,
                    "num_computed_tokens": request.num_computed_tokens,
                },
            )
        )
        params = request.kv_transfer_params
        if num_external_tokens > 0 and params is not None:
            self.pending_loads.append(ToyLoad(request.request_id, unhashed, num_external_tokens))
            params["do_remote_prefill"] = False  # load once; a retry recomputes

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ToyConnectorMetadata(loads=self.pending_loads)
        self.pending_loads = []
        self.calls.append(ToyCall("build_connector_meta", None, {"loads": meta.loads}))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.calls.append(
            ToyCall(
                "update_connector_output",
                None,
                {
                    "finished_sending": set(connector_output.finished_sending or ()),
                    "finished_recving": set(connector_output.finished_recving or ()),
                    "failed_recving": set(connector_output.failed_recving),
                },
            )
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(
            ToyCall(
                "request_finished",
                request.request_id,
                {
                    "status": request.status,
                    "block_ids": list(block_ids),
                    "num_computed_tokens": request.num_computed_tokens,
                },
            )
        )
        return self.delay_free_on_finish, {"toy_request_id": request.request_id}

    # ---- worker side (unused by the harness) ----------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: Any,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
