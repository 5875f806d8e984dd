"""The hooks benchmark's baseline connector and its comparison report.

The floor connector runs through the REAL vLLM 0.32 Scheduler: it must give
vLLM the same request flow as pushkv (decode waits for an asynchronous load,
prefill keeps its blocks until they are reported sent), or the benchmark
would compare different engine loops.
"""

from __future__ import annotations

import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from pushkv.bench.floor_connector import FloorConnector, FloorMetadata
from pushkv.bench.hooks.report import compare_lines, final_line
from tests.support.vllm_harness import (
    kv_output,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    num_free_blocks,
    prompt_tokens,
    step,
)

BLOCK = 16


def _engine(model_dir: Any, kv_role: str) -> tuple[Any, FloorConnector]:
    cfg = make_vllm_config(
        model_dir,
        connector_module="pushkv.bench.floor_connector",
        connector_name="FloorConnector",
        kv_role=kv_role,
        block_size=BLOCK,
        enable_prefix_caching=False,
    )
    sched = make_scheduler(cfg, num_blocks=64)
    assert isinstance(sched.connector, FloorConnector)
    worker = FloorConnector(cfg, KVConnectorRole.WORKER, make_kv_cache_config(cfg, num_blocks=64))
    return sched, worker


def _worker_step(worker: FloorConnector, meta: Any) -> Any:
    """The worker's calls of one step, in vLLM 0.32's order."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    results = worker.get_transfer_results(set())
    worker.clear_connector_metadata()
    return results


def test_floor_decode_waits_for_its_load_then_runs(tiny_model_dir: Any) -> None:
    sched, worker = _engine(tiny_model_dir, "kv_consumer")
    req = make_request(
        "d1",
        prompt_tokens(40),
        sched.vllm_config,
        max_tokens=4,
        kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t1"},
    )
    sched.add_request(req)
    out, _ = step(sched)
    # Allocated, claimed as an asynchronous load: nothing computed this step.
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.total_num_scheduled_tokens == 0
    meta = out.kv_connector_metadata
    assert isinstance(meta, FloorMetadata) and meta.recv == ["d1"]
    results = _worker_step(worker, meta)
    assert results.finished_recving == {"d1"} and not results.finished_sending
    step(sched, connector_output=kv_output(finished_recving=results.finished_recving))
    out, _ = step(sched)
    # Released: only the last prompt token is computed, then it decodes.
    assert out.num_scheduled_tokens == {"d1": 1}
    # Reported once only.
    assert not _worker_step(worker, out.kv_connector_metadata).finished_recving


def test_floor_prefill_holds_its_blocks_until_reported_sent(tiny_model_dir: Any) -> None:
    sched, worker = _engine(tiny_model_dir, "kv_producer")
    free = num_free_blocks(sched)
    req = make_request(
        "p1",
        prompt_tokens(40),
        sched.vllm_config,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "t1"},
    )
    sched.add_request(req)
    out, _ = step(sched)  # the whole prompt, one token: finished
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert num_free_blocks(sched) < free  # held for the (absent) transfer
    out, _ = step(sched)
    meta = out.kv_connector_metadata
    assert isinstance(meta, FloorMetadata) and meta.send == ["p1"]
    results = _worker_step(worker, meta)
    assert results.finished_sending == {"p1"}
    step(sched, connector_output=kv_output(finished_sending=results.finished_sending))
    assert num_free_blocks(sched) == free
    assert "p1" not in sched.requests


def test_floor_ignores_requests_without_transfer_params(tiny_model_dir: Any) -> None:
    sched, worker = _engine(tiny_model_dir, "kv_consumer")
    req = make_request("plain", prompt_tokens(40), sched.vllm_config, max_tokens=2)
    sched.add_request(req)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"plain": 40}  # computed locally
    results = _worker_step(worker, out.kv_connector_metadata)
    assert not results.finished_recving and not results.finished_sending


def _summary(busy: tuple[float, float], quiet: tuple[float, float]) -> dict[str, Any]:
    def row(p50: float, p99: float) -> dict[str, float]:
        return {"steps": 100, "p50_us": p50, "p99_us": p99}

    return {
        "all/busy": row(*busy),
        "all-cpu/busy": row(busy[0] + 5, busy[1] + 5),
        "all/busy-quiet": row(*quiet),
        "scheduler/busy": row(busy[0] / 2, busy[1] / 2),
    }


def test_report_compares_pushkv_with_the_floor_per_engine() -> None:
    summaries = {
        ("poisson", "pushkv"): {
            "prefill": _summary((50, 150), (math.nan, math.nan)),
            "decode": _summary((30, 160), (25, 100)),
        },
        ("poisson", "floor"): {
            "prefill": _summary((20, 40), (math.nan, math.nan)),
            "decode": _summary((20, 50), (15, 40)),
        },
    }
    lines = compare_lines(summaries, ["poisson"])
    decode_busy = next(ln for ln in lines if "| decode | busy steps, all hooks" in ln)
    assert "| 30.0 / 160.0 | 20.0 / 50.0 | 3.20 | 110.0 |" in decode_busy
    prefill_busy = next(ln for ln in lines if "| prefill | busy steps, all hooks" in ln)
    assert "| 3.75 |" in prefill_busy
    # A prefill engine has no quiet steps: no row rather than a row of nan.
    assert not any("| prefill | busy steps that start or finish no request" in ln for ln in lines)
    # The worse engine's p99 on each side, and the verdict against the goal.
    assert final_line(summaries, ["poisson"]) == (
        "poisson: hooks_p99_us_per_busy_step=160.0 cpu_p99_us=165.0 floor_p99_us=50.0 "
        "(wall, worse engine; goal <= 50: poisson missed)"
    )


def test_report_without_the_floor_has_no_comparison() -> None:
    summaries = {("closed", "pushkv"): {"decode": _summary((20, 45), (10, 30))}}
    assert compare_lines(summaries, ["closed"]) == []
    assert final_line(summaries, ["closed"]) == (
        "closed: hooks_p99_us_per_busy_step=45.0 cpu_p99_us=50.0 "
        "(wall, worse engine; goal <= 50: closed met)"
    )
