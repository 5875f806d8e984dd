"""The connector's counters in vLLM's own /metrics, through vLLM's connector
stats API (vllm/distributed/kv_transfer/kv_connector/v1/metrics.py).

* Worker rank (engine thread): `PushKVConnector.get_kv_connector_stats`
  answers each step with a `PushKVStats` holding what that rank counted
  since its last answer (vllm_integration/metrics.py, `StepStats`), or None.
* Engine core: vLLM adds the ranks' answers up (`aggregate`) and sends the
  sum's `data` to the API server with its scheduler stats.
* API server: `PushKVPromMetrics.observe` adds them to its counters, served
  on vLLM's /metrics with vLLM's labels (model_name, engine: the engine core's
  index) and ours (engine_id: the pushkv engine; rank).

`data` is plain: {"engine_id": str, "ranks": {rank: {key: count}}}, keys as in
metrics.COUNTED; vLLM pickles it between processes.
"""

from __future__ import annotations

from typing import Any

from pushkv.vllm_integration.compat import KVConnectorPromMetrics, KVConnectorStats
from pushkv.vllm_integration.metrics import COUNTED, Counted

_BY_KEY = {c.key: c for c in COUNTED}
# One counter per metric name in the API server's process, whatever builds
# the logger again (vLLM unregisters only its own "vllm:" metrics between
# loggers; prometheus_client refuses a name registered twice).
_COUNTERS: dict[tuple[type, str, tuple[str, ...]], Any] = {}


class PushKVStats(KVConnectorStats):  # type: ignore[misc]
    """What the ranks counted over some steps: summed per rank."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        empty: dict[str, Any] = {"engine_id": "", "ranks": {}}
        self.data = empty

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        data = other.data
        if not self.data.get("engine_id"):
            self.data["engine_id"] = data.get("engine_id", "")
        ranks: dict[str, dict[str, int]] = self.data.setdefault("ranks", {})
        for rank, counts in data.get("ranks", {}).items():
            mine = ranks.setdefault(rank, {})
            for key, n in counts.items():
                mine[key] = mine.get(key, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        """Totals over the ranks, for vLLM's periodic "KV Transfer metrics" log line."""
        out: dict[str, int | float] = {}
        for counts in self.data.get("ranks", {}).values():
            for key, n in counts.items():
                if key in ("run_ns", "wait_ns"):
                    continue
                out[key] = out.get(key, 0) + n
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get("ranks", {}).values())


def rank_stats(engine_id: str, rank: int, counts: dict[str, int] | None) -> PushKVStats | None:
    """One rank's answer to vLLM (None: nothing counted since the last)."""
    if counts is None:
        return None
    return PushKVStats(data={"engine_id": engine_id, "ranks": {str(rank): counts}})


class PushKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The connector's counters in the API server's registry."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for c in COUNTED:
            if c.metric not in self._metrics:
                names = [*labelnames, "engine_id", "rank", *([c.label[0]] if c.label else [])]
                self._metrics[c.metric] = _counter(self._counter_cls, c, names)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = self.per_engine_labelvalues[engine_idx]
        engine_id = str(transfer_stats_data.get("engine_id", ""))
        for rank, counts in transfer_stats_data.get("ranks", {}).items():
            for key, n in counts.items():
                c = _BY_KEY.get(key)
                if c is None or n <= 0:  # a key of a newer worker; counters only grow
                    continue
                extra = [c.label[1]] if c.label else []
                series = self._metrics[c.metric].labels(*base, engine_id, str(rank), *extra)
                series.inc(n * c.scale)


def _counter(cls: type, c: Counted, labelnames: list[str]) -> Any:
    key = (cls, c.metric, tuple(labelnames))
    found = _COUNTERS.get(key)
    if found is None:
        found = _COUNTERS[key] = cls(name=c.metric, documentation=c.doc, labelnames=labelnames)
    return found
