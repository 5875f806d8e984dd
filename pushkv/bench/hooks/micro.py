"""The warm per-call cost of the per-request hooks, in one process (``--micro``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from pushkv.bench.hooks.config import HookConfig, prompt, request, vllm_config
from pushkv.bench.output import table_head, table_row
from pushkv.harness import offline


def micro(model_dir: str, n: int = 4000, reps: int = 5) -> list[str]:
    """Warm per-call cost of the scheduler half's per-request hooks (µs).

    One process, real ``Request`` and ``KVCacheBlocks`` objects, no engine loop:
    the connector's coordinator calls are captured in a deque instead of sent,
    so only the hook's own Python is timed. Hooks that change state on their
    first call for a request are timed over one pass of fresh requests; the
    others are the best of `reps` passes."""
    lines = table_head("engine", "hook", "µs per call")
    for role in ("prefill", "decode"):
        lines += [
            table_row(role, name, f"{us:.2f}") for name, us in _micro_role(model_dir, role, n, reps)
        ]
    return lines


def _micro_role(model_dir: str, role: str, n: int, reps: int) -> list[tuple[str, float]]:
    import collections
    import gc

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import RequestStatus

    from pushkv.vllm_integration.client import Call
    from pushkv.vllm_integration.connector import PushKVConnector

    cfg = HookConfig(model_dir=model_dir, coordinator="127.0.0.1:9", run_id="micro")
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    vcfg = vllm_config(cfg, kv_role, f"micro-{role}")
    conn = PushKVConnector(vcfg, KVConnectorRole.SCHEDULER, offline.kv_cache_config(vcfg, 8192))
    half = conn._scheduler
    assert half is not None
    half.client.close(1.0)
    captured: collections.deque[Call] = collections.deque()
    half.client.submit = captured.append  # type: ignore[method-assign,assignment]
    side = "do_remote_decode" if role == "prefill" else "do_remote_prefill"
    reqs = [
        request(cfg, vcfg, f"{role}-{i}", prompt(cfg, i), {side: True, "transfer_id": f"t{i}"})
        for i in range(n)
    ]
    blocks = [
        KVCacheBlocks(([KVCacheBlock(j) for j in range(i % 100, i % 100 + 20)],)) for i in range(n)
    ]
    external = 0 if role == "prefill" else 1
    ids = list(range(10))

    def timed(fn: Callable[[int], Any], passes: int) -> float:
        best = math.inf
        for _ in range(passes):
            t = time.perf_counter_ns()
            for i in range(n):
                fn(i)
            best = min(best, (time.perf_counter_ns() - t) / n / 1000)
        return best

    gc.collect()
    gc.disable()
    try:
        rows = [
            (
                "get_num_new_matched_tokens",
                timed(lambda i: conn.get_num_new_matched_tokens(reqs[i], 0), reps),
            ),
            (
                "update_state_after_alloc (first call)",
                timed(lambda i: conn.update_state_after_alloc(reqs[i], blocks[i], external), 1),
            ),
            (
                "update_state_after_alloc (again)",
                timed(lambda i: conn.update_state_after_alloc(reqs[i], blocks[i], 0), reps),
            ),
        ]
        # As vLLM would: the decode legs' KV arrived, the prefill legs finished.
        conn.update_connector_output(
            type("Out", (), {"finished_recving": [r.request_id for r in reqs]})()
        )
        for r in reqs:
            r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        # The hook vLLM calls (the connector is SupportsHMA), with one KV group.
        groups = (ids,)
        rows.append(
            (
                "request_finished_all_groups",
                timed(lambda i: conn.request_finished_all_groups(reqs[i], groups), 1),
            )
        )
        rows.append(("(the timing loop itself)", timed(lambda i: None, reps)))
    finally:
        gc.enable()
        conn.shutdown()
    return rows
