"""The pushkv KV connector for vLLM: a facade over the scheduler and worker halves.

Enable it on both engines with (vLLM finds it by name through pushkv's
`vllm.general_plugins` entry point, vllm_integration/plugin.py)

  --kv-transfer-config '{"kv_connector": "PushKVConnector",
     "kv_role": "kv_producer" | "kv_consumer", "engine_id": "<stable id>",
     "kv_connector_extra_config": {"coordinator": "host:port", "api_url": "http://..."}}'
"""

from __future__ import annotations

import logging
from typing import Any

from pushkv.vllm_integration import compat, kv_checks, logs
from pushkv.vllm_integration.compat import (
    KVConnectorBase_V1,
    KVConnectorRole,
    NoLayerwiseHooks,
    SupportsHMA,
)
from pushkv.vllm_integration.metadata import PushKVMetadata
from pushkv.vllm_integration.scheduler import PushSchedulerHalf
from pushkv.vllm_integration.settings import ConnectorSettings
from pushkv.vllm_integration.stats import PushKVPromMetrics, PushKVStats, rank_stats
from pushkv.vllm_integration.worker import PushWorkerHalf

log = logging.getLogger("pushkv.connector")


class PushKVConnector(NoLayerwiseHooks, KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """SupportsHMA: vLLM keeps its hybrid KV cache manager on, so a model with
    sliding-window and full-attention layers keeps its KV cache groups and
    pushkv moves each group's blocks (a sliding-window group only its window's)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(tc.kv_connector_extra_config)
        logs.route_to_engine_log(self.settings.log_level)
        if tc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(
                f"PushKVConnector needs kv_role kv_producer (prefill) or kv_consumer "
                f"(decode), not {tc.kv_role!r}"
            )
        kv_checks.check_kv_cache_config(vllm_config, kv_cache_config)  # refuse at start
        compat.set_load_failure_policy(tc, self.settings.on_transfer_failure)
        self.is_prefill = tc.kv_role == "kv_producer"
        self.engine_id = str(tc.engine_id)
        block_size = int(vllm_config.cache_config.block_size)
        kv_groups = len(kv_cache_config.kv_cache_groups)
        windows = tuple(
            (int(g.kv_cache_spec.sliding_window), int(g.kv_cache_spec.extra_retained_tokens))
            for g in kv_cache_config.kv_cache_groups
            if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec"
        )
        self._scheduler: PushSchedulerHalf | None = None
        self._worker: PushWorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            half = self._scheduler = PushSchedulerHalf(
                self.settings, self.engine_id, block_size, kv_groups, windows
            )
            # vLLM calls these for every request on its engine thread: bound
            # straight to the half, they cost one Python call instead of two.
            self.get_num_new_matched_tokens = half.get_num_new_matched_tokens  # type: ignore[method-assign]
            self.update_state_after_alloc = half.update_state_after_alloc  # type: ignore[method-assign]
            self.request_finished = half.request_finished  # type: ignore[method-assign]
            self.request_finished_all_groups = half.request_finished_all_groups  # type: ignore[method-assign]
        else:
            rank, size = compat.tp_rank_and_size()
            pp_rank, pp_size = compat.pp_rank_and_size()
            geometry = compat.kv_geometry(vllm_config)
            kv_heads = int(geometry.pop("kv_heads_per_rank"))
            mla = kv_checks.mla_geometry(kv_cache_config)
            self._worker = PushWorkerHalf(
                self.settings,
                engine_id=self.engine_id,
                is_prefill=self.is_prefill,
                tp_rank=rank,
                tp_size=size,
                tokens_per_block=block_size,
                num_blocks=int(kv_cache_config.num_blocks),
                compat=geometry,
                kv_heads=kv_heads,
                kv_groups=kv_groups,
                mla_head_size=mla[1] if mla else 0,
                pp_rank=pp_rank,
                pp_size=pp_size,
                total_layers=compat.total_layers(vllm_config) if pp_size > 1 else 0,
            )

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PushKVMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished_all_groups(request, block_ids)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return kv_checks.REQUIRED_KV_LAYOUT  # the only one regions_of plans

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        kv_checks.check_kv_tensors(kv_caches, self._kv_cache_config, self._vllm_config)
        self._worker.register_kv_caches(kv_caches)

    def _meta(self) -> PushKVMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, PushKVMetadata) else None

    def _idle(self) -> bool:
        meta = self._meta()
        return bool(meta and meta.idle)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_save(self) -> None:
        # Called after each step's forward (NoLayerwiseHooks has it as a no-op).
        if self._worker is not None:
            self._worker.fire(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids, idle=self._idle())

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        worker = self._worker
        assert worker is not None
        sending, recving = worker.get_finished(finished_req_ids, idle=self._idle())
        failed = worker.take_failed()
        if compat.KVConnectorTransferResults is None:  # pragma: no cover - vLLM < 0.30
            return sending, recving
        return compat.KVConnectorTransferResults(
            finished_sending=sending or set(),
            finished_recving=recving or set(),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    # ------------------------------------------------------------ metrics
    def get_kv_connector_stats(self) -> PushKVStats | None:
        """After every step, on each worker rank: what it counted since it
        last answered (vLLM sums the ranks' and its API server serves them
        on /metrics: vllm_integration/stats.py). None on the scheduler side."""
        w = self._worker
        if w is None:
            return None
        return rank_stats(self.engine_id, w.rank, w.step_stats.take())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PushKVStats:
        return PushKVStats(data=data) if data is not None else PushKVStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PushKVPromMetrics:
        return PushKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
