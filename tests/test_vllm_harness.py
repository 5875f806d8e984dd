"""The vLLM harness drives a toy connector through the REAL vLLM 0.32 Scheduler.

Each test pins one piece of scheduler behaviour a push connector depends on
(see docs/dev/vllm-0.32-connector-notes.md).
"""

from __future__ import annotations

import pytest
from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from tests.support.toy_connector import ToyConnector
from tests.support.vllm_harness import (
    DEFAULT_SAMPLED_TOKEN,
    kv_output,
    make_request,
    make_scheduler,
    make_vllm_config,
    num_free_blocks,
    prompt_tokens,
    step,
)

BLOCK = 16
REMOTE = {"do_remote_prefill": True}


def _status(req: Request) -> RequestStatus:
    """Read the status through a call so mypy does not narrow it across steps."""
    return req.status


def _connector(scheduler: Scheduler) -> ToyConnector:
    conn = scheduler.connector
    assert isinstance(conn, ToyConnector)
    return conn


@pytest.fixture
def vllm_config(tiny_model_dir):
    return make_vllm_config(tiny_model_dir, block_size=BLOCK)


@pytest.fixture
def scheduler(vllm_config):
    return make_scheduler(vllm_config, num_blocks=64)


def _start_remote_load(
    scheduler: Scheduler,
    vllm_config: VllmConfig,
    rid: str = "r1",
    n_tokens: int = 40,
    max_tokens: int = 3,
) -> Request:
    req = make_request(
        rid, prompt_tokens(n_tokens), vllm_config, max_tokens=max_tokens, kv_transfer_params=REMOTE
    )
    scheduler.add_request(req)
    sched_out, _ = step(scheduler)
    assert _status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched_out.total_num_scheduled_tokens == 0
    return req


def test_config_uses_toy_connector_without_hma(vllm_config, scheduler):
    assert vllm_config.cache_config.block_size == BLOCK
    # A connector that is not SupportsHMA auto-disables the hybrid KV cache manager.
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is True
    assert len(scheduler.kv_cache_config.kv_cache_groups) == 1
    assert isinstance(scheduler.connector, ToyConnector)


def test_async_load_waits_then_runs(vllm_config, scheduler):
    free0 = num_free_blocks(scheduler)
    req = _start_remote_load(scheduler, vllm_config, n_tokens=40)  # 16 + 16 + 8
    conn = _connector(scheduler)

    (matched,) = conn.calls_to("get_num_new_matched_tokens")
    assert matched.args == {"num_computed_tokens": 0, "returned": 40}
    (alloc,) = conn.calls_to("update_state_after_alloc")
    assert alloc.args["num_external_tokens"] == 40
    assert len(alloc.args["block_ids"]) == 3
    assert alloc.args["unhashed_block_ids"] == alloc.args["block_ids"]  # async: not cached yet
    (load,) = conn.calls_to("build_connector_meta")[0].args["loads"]
    assert load.block_ids == alloc.args["block_ids"]
    assert num_free_blocks(scheduler) == free0 - 3

    # The engine keeps stepping while the load is in flight: nothing is scheduled.
    for _ in range(3):
        sched_out, _ = step(scheduler)
        assert sched_out.total_num_scheduled_tokens == 0
        assert _status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert scheduler.has_requests()

    # Workers report completion; the request is promoted on the NEXT schedule().
    step(scheduler, connector_output=kv_output(finished_recving={req.request_id}))
    assert _status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched_out, outputs = step(scheduler)
    assert _status(req) == RequestStatus.RUNNING
    # num_computed_tokens = prompt_len - 1: only the last prompt token is recomputed.
    assert sched_out.num_scheduled_tokens == {req.request_id: 1}
    assert req.num_computed_tokens == 40
    assert list(req.output_token_ids) == [DEFAULT_SAMPLED_TOKEN]
    (out,) = outputs[0].outputs
    assert out.prefill_stats is not None
    assert out.prefill_stats.num_external_cached_tokens == 40
    second_alloc = conn.calls_to("update_state_after_alloc")[1]
    assert second_alloc.args["num_external_tokens"] == 0
    assert second_alloc.args["num_computed_tokens"] == 39

    # Run to completion (max_tokens=3): request_finished sees all blocks, then frees.
    step(scheduler)
    _, outputs = step(scheduler)
    assert _status(req) == RequestStatus.FINISHED_LENGTH_CAPPED
    (fin,) = conn.calls_to("request_finished")
    assert fin.args["block_ids"] == alloc.args["block_ids"]
    (out,) = outputs[0].outputs
    assert out.kv_transfer_params == {"toy_request_id": req.request_id}
    assert req.request_id not in scheduler.requests
    assert num_free_blocks(scheduler) == free0  # cached blocks count as free (evictable)


def test_abort_while_waiting_holds_blocks_until_finished_recving(vllm_config, scheduler):
    free0 = num_free_blocks(scheduler)
    req = _start_remote_load(scheduler, vllm_config, n_tokens=40)
    conn = _connector(scheduler)

    scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    (fin,) = conn.calls_to("request_finished")
    assert fin.args["status"] == RequestStatus.FINISHED_ABORTED
    assert len(fin.args["block_ids"]) == 3  # every block allocated for the load
    # The connector returned False, yet the blocks stay allocated: an in-flight
    # load may still write them.  The engine keeps stepping meanwhile.
    assert req.request_id in scheduler.requests
    assert num_free_blocks(scheduler) == free0 - 3
    assert scheduler.has_requests()
    step(scheduler)
    assert num_free_blocks(scheduler) == free0 - 3

    # Reporting the id in finished_recving releases them.
    step(scheduler, connector_output=kv_output(finished_recving={req.request_id}))
    assert req.request_id not in scheduler.requests
    assert num_free_blocks(scheduler) == free0
    assert not scheduler.has_requests()

    # Reporting an id the scheduler no longer knows crashes the engine (assert).
    with pytest.raises(AssertionError):
        step(scheduler, connector_output=kv_output(finished_recving={req.request_id}))


def test_failed_load_with_fail_policy_errors_request(vllm_config, scheduler):
    assert vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"  # 0.32 default
    free0 = num_free_blocks(scheduler)
    req = _start_remote_load(scheduler, vllm_config)
    rid = req.request_id
    _, outputs = step(
        scheduler, connector_output=kv_output(failed_recving={rid}, finished_recving={rid})
    )
    assert _status(req) == RequestStatus.FINISHED_ERROR
    (out,) = outputs[0].outputs
    assert str(out.finish_reason) == "error"
    (fin,) = _connector(scheduler).calls_to("request_finished")
    assert fin.args["status"] == RequestStatus.FINISHED_ERROR
    assert rid not in scheduler.requests
    assert num_free_blocks(scheduler) == free0


def test_failed_load_with_recompute_policy_recomputes_locally(tiny_model_dir):
    cfg = make_vllm_config(tiny_model_dir, block_size=BLOCK, kv_load_failure_policy="recompute")
    scheduler = make_scheduler(cfg, num_blocks=64)
    req = _start_remote_load(scheduler, cfg, n_tokens=40)
    rid = req.request_id
    step(scheduler, connector_output=kv_output(failed_recving={rid}, finished_recving={rid}))
    sched_out, _ = step(scheduler)
    assert _status(req) == RequestStatus.RUNNING
    assert sched_out.num_scheduled_tokens == {rid: 40}  # full local prefill
    calls = _connector(scheduler).calls_to("get_num_new_matched_tokens")
    assert [c.args["returned"] for c in calls] == [40, 0]


def test_local_prefix_hit_shrinks_external_tokens(vllm_config, scheduler):
    prompt = prompt_tokens(40, seed=3)
    local = make_request("local", prompt, vllm_config, max_tokens=1)
    scheduler.add_request(local)
    step(scheduler)
    assert _status(local) == RequestStatus.FINISHED_LENGTH_CAPPED
    conn = _connector(scheduler)
    local_blocks = conn.calls_to("request_finished")[0].args["block_ids"]

    remote = make_request("remote", prompt, vllm_config, max_tokens=1, kv_transfer_params=REMOTE)
    scheduler.add_request(remote)
    step(scheduler)
    matched = conn.calls_to("get_num_new_matched_tokens")[-1]
    # Two full blocks hit locally; only the 8-token tail is loaded externally.
    assert matched.args == {"num_computed_tokens": 32, "returned": 8}
    alloc = conn.calls_to("update_state_after_alloc")[-1]
    assert alloc.args["block_ids"][:2] == local_blocks[:2]
    assert len(alloc.args["unhashed_block_ids"]) == 1
    assert alloc.args["unhashed_block_ids"] == alloc.args["block_ids"][2:]


def test_producer_delay_free_until_finished_sending(vllm_config, scheduler):
    conn = _connector(scheduler)
    conn.delay_free_on_finish = True
    free0 = num_free_blocks(scheduler)
    req = make_request(
        "p1",
        prompt_tokens(33),
        vllm_config,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True},
    )
    scheduler.add_request(req)
    _, outputs = step(scheduler)
    assert _status(req) == RequestStatus.FINISHED_LENGTH_CAPPED
    (out,) = outputs[0].outputs
    assert out.kv_transfer_params == {"toy_request_id": "p1"}
    (fin,) = conn.calls_to("request_finished")
    # max_tokens=1: every prompt token is computed; the blocks cover the prompt.
    assert fin.args["num_computed_tokens"] == 33
    assert len(fin.args["block_ids"]) == 3
    assert num_free_blocks(scheduler) == free0 - 3
    assert scheduler.has_requests()  # finished-but-unfreed keeps the engine stepping

    step(scheduler, connector_output=kv_output(finished_sending={"p1"}))
    assert "p1" not in scheduler.requests
    assert num_free_blocks(scheduler) == free0
