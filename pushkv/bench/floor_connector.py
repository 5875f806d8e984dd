"""The hooks benchmark's baseline: a KV connector with pushkv's request flow and no work.

`pushkv bench hooks` runs it side by side with `PushKVConnector`, so the report
can say how much of a step's hook time is vLLM calling into *any* Python
connector on this machine, and how much is pushkv's own.

The flow is the one vLLM's scheduler sees from pushkv:

- decode: a request with ``do_remote_prefill`` claims its uncached prompt as an
  asynchronous load and is reported received one step after its blocks are
  allocated;
- prefill: a request with ``do_remote_decode`` keeps its blocks when it
  finishes and is reported sent one step later.

Nothing is transferred, registered or counted, and there are no threads. Not
for serving: the decode side would generate from blocks nobody wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pushkv.vllm_integration.compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    NoLayerwiseHooks,
)


@dataclass
class FloorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    recv: list[str] = field(default_factory=list)  # decode requests whose load is done
    send: list[str] = field(default_factory=list)  # prefill requests whose blocks are held


class FloorConnector(NoLayerwiseHooks, KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        self._claimed: set[str] = set()  # scheduler: decode requests given a load
        self._meta = FloorMetadata()
        self._recving: set[str] = set()  # worker: reported at the next get_finished
        self._sending: set[str] = set()

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        raw = request.kv_transfer_params
        if not raw or not raw.get("do_remote_prefill") or request.request_id in self._claimed:
            return 0, False
        remaining = request.num_prompt_tokens - num_computed_tokens
        return (remaining, True) if remaining > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens > 0 and rid not in self._claimed:
            self._claimed.add(rid)
            self._meta.recv.append(rid)

    def build_connector_meta(self, scheduler_output: Any) -> FloorMetadata:
        meta, self._meta = self._meta, FloorMetadata()
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._claimed.discard(rid)
        raw = request.kv_transfer_params
        if raw and raw.get("do_remote_decode") and block_ids:
            self._meta.send.append(rid)
            return True, None
        return False, None

    # ------------------------------------------------------------ worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, FloorMetadata):
            self._recving.update(meta.recv)
            self._sending.update(meta.send)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, self._sending = self._sending, set()
        recving, self._recving = self._recving, set()
        return sending or None, recving or None
