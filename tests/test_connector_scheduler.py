"""PushKVConnector's SCHEDULER half inside a REAL vLLM 0.32 Scheduler.

What is real: the vLLM ``Scheduler``/``KVCacheManager``/``Request`` (built by
tests/support/vllm_harness.py), the connector loaded by ``KVConnectorFactory`` from
``kv_connector_module_path``, and a coordinator process the connector's client
thread talks gRPC to.  The engines' agents are ``SimAgent``s (real agent
streams, no NIXL): the coordinator only accepts block reports from engines
whose agents registered.  The worker is played by the harness (`step` feeds
``KVConnectorOutput`` back as the aggregated workers would).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.rules.block_groups import of
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.client import Call, CoordinatorClient, Result
from pushkv.vllm_integration.connector import PushKVConnector
from pushkv.vllm_integration.metadata import PushKVMetadata, RecvSpec
from pushkv.vllm_integration.settings import ConnectorSettings
from tests.support.sim_agent import SimAgent
from tests.support.sim_agent import layout as sim_layout
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

BLOCK = 16  # matches the SimAgent layout's tokens_per_block
DEADLINE_S = 10.0


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def coord() -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess("--log-level", "WARNING").start()
    yield c
    c.stop()


@dataclass
class Stubs:
    status: pbg.StatusServiceAsyncStub
    transfers: pbg.TransferServiceAsyncStub


@pytest.fixture
async def stubs(coord: CoordinatorProcess) -> AsyncIterator[Stubs]:
    channel = grpc.aio.insecure_channel(coord.address)
    yield Stubs(pbg.StatusServiceStub(channel), pbg.TransferServiceStub(channel))
    await channel.close(None)


@dataclass
class Spy:
    """Records the connector's request_finished results and coordinator calls."""

    finished: dict[str, tuple[RequestStatus, list[int], tuple[bool, dict[str, Any] | None]]] = (
        field(default_factory=dict)
    )
    calls: list[Call] = field(default_factory=list)
    # Every KV cache group's block ids vLLM handed request_finished_all_groups.
    all_groups: dict[str, tuple[list[int], ...]] = field(default_factory=dict)


@dataclass
class Engine:
    engine_id: str
    config: VllmConfig
    scheduler: Scheduler
    agent: SimAgent | None
    spy: Spy

    @property
    def connector(self) -> PushKVConnector:
        conn = self.scheduler.connector
        assert isinstance(conn, PushKVConnector)
        return conn

    @property
    def client(self) -> CoordinatorClient:
        half = self.connector._scheduler
        assert half is not None
        return half.client

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def wait_result(self, kind: str, timeout: float = DEADLINE_S) -> Result:
        """Block until the client thread has a result of `kind` queued; leave it there.

        build_connector_meta drains results without waiting, so a test waits
        here first to make the next step deterministic.
        """
        r = self.client.wait_result(lambda r: r.call.kind == kind, timeout)
        if r is None:
            raise AssertionError(f"no {kind!r} result within {timeout} s")
        return r


def _spy(conn: PushKVConnector, spy: Spy) -> None:
    # The connector is SupportsHMA, so vLLM's scheduler calls
    # request_finished_all_groups (one group here: the tiny Llama).
    orig_finished = conn.request_finished_all_groups

    def request_finished_all_groups(request: Request, block_ids: tuple[list[int], ...]) -> Any:
        result = orig_finished(request, block_ids)
        spy.finished[request.request_id] = (request.status, list(block_ids[0]), result)
        spy.all_groups[request.request_id] = tuple(list(g) for g in block_ids)
        return result

    conn.request_finished_all_groups = request_finished_all_groups  # type: ignore[method-assign]
    half = conn._scheduler
    assert half is not None
    orig_submit = half.client.submit

    def submit(call: Call) -> None:
        spy.calls.append(call)
        orig_submit(call)

    half.client.submit = submit  # type: ignore[method-assign]


@asynccontextmanager
async def engine(
    coord: CoordinatorProcess,
    model_dir: Path,
    role: str,
    *,
    register_agent: bool = True,
    agent_role: str | None = None,
    window: int | None = None,
    **config: Any,
) -> AsyncIterator[Engine]:
    """A scheduler with PushKVConnector for a fresh engine id (its agent registered).

    With `window`, vLLM's hybrid KV cache manager over two KV cache groups: full
    attention (layer 1) and a sliding window of `window` tokens (layer 0)."""
    engine_id = f"{'dec' if role == 'kv_consumer' else 'pre'}-{uuid.uuid4().hex[:8]}"
    agent = None
    if register_agent:
        agent_role = agent_role or ("decode" if role == "kv_consumer" else "prefill")
        kv_layout = None
        if window is not None:  # the agent lists its regions once per group
            kv_layout = sim_layout()
            kv_layout.regions.extend(
                [pb.KVRegion(group=1, **_region_fields(r)) for r in kv_layout.regions]
            )
        agent = SimAgent(
            coord.address, engine_id, agent_role, heartbeat_interval=0.5, kv_layout=kv_layout
        )
        await agent.start()
    # The connector's on_transfer_failure sets vLLM's kv_load_failure_policy;
    # these tests name the policy they exercise ("fail" unless told).
    policy = config.pop("kv_load_failure_policy", "fail")
    # In process: no HTTP server, so no api_url (routable false).
    extra = {"coordinator": coord.address, "on_transfer_failure": policy, "routable": False}
    if "progressive_push" in config:
        extra["progressive_push"] = config.pop("progressive_push")
    cfg = make_vllm_config(
        model_dir,
        connector_module="pushkv.vllm_integration.connector",
        connector_name="PushKVConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config=extra,
        block_size=BLOCK,
        **config,
    )
    sched = make_scheduler(cfg, num_blocks=64) if window is None else hybrid_scheduler(cfg, window)
    eng = Engine(engine_id, cfg, sched, agent, Spy())
    _spy(eng.connector, eng.spy)
    try:
        yield eng
    finally:
        sched.shutdown()
        if agent is not None:
            await agent.close()


def _region_fields(r: pb.KVRegion) -> dict[str, Any]:
    return {
        "base_addr": r.base_addr,
        "block_len": r.block_len,
        "num_blocks": r.num_blocks,
        "name": f"group1-{r.name}",
    }


def hybrid_scheduler(cfg: VllmConfig, window: int, num_blocks: int = 64) -> Scheduler:
    """vLLM's Scheduler with its hybrid KV cache manager over a full-attention
    group and a sliding-window group (one block pool, as vLLM builds for Gemma-2)."""
    cfg.cache_config.num_gpu_blocks = num_blocks
    spec: dict[str, Any] = {
        "block_size": BLOCK,
        "num_kv_heads": 2,
        "head_size": 32,
        "dtype": torch.float32,
    }
    kv = KVCacheConfig(
        num_blocks,
        [],
        [
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(**spec)),
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                SlidingWindowSpec(sliding_window=window, **spec),
            ),
        ],
    )
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        log_stats=True,
    )


async def wait_transfer(
    stubs: Stubs,
    transfer_id: str,
    done: Callable[[pb.TransferStatus], bool],
    deadline_s: float = DEADLINE_S,
) -> pb.TransferStatus:
    """Watch the coordinator until the transfer satisfies `done` (within `deadline_s`)."""
    last: pb.TransferStatus | None = None
    call = stubs.status.WatchTransfers(
        pb.WatchTransfersRequest(include_existing=True), timeout=deadline_s
    )
    try:
        async for ev in call:
            if ev.transfer.transfer_id == transfer_id:
                last = ev.transfer
                if done(last):
                    return last
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    finally:
        call.cancel()
    raise AssertionError(
        f"transfer {transfer_id} did not get there in {deadline_s} s; last: {last}"
    )


def in_state(state: int) -> Callable[[pb.TransferStatus], bool]:
    return lambda t: t.state == state


def decode_params(tid: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "transfer_id": tid}


def prefill_params(tid: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "transfer_id": tid}


def new_tid() -> str:
    return f"tx-{uuid.uuid4().hex}"


def _status(req: Request) -> RequestStatus:
    """Through a call, so type checkers do not narrow the status across steps."""
    return req.status


def _meta(sched_out: Any) -> PushKVMetadata:
    meta = sched_out.kv_connector_metadata
    assert isinstance(meta, PushKVMetadata)
    return meta


# ---------------------------------------------------------------- decode side


async def test_decode_claims_uncached_suffix_and_registers_its_blocks(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    async with engine(coord, tiny_model_dir, "kv_consumer") as eng:
        tid = new_tid()
        req = make_request(
            "d1", prompt_tokens(40), eng.config, max_tokens=2, kv_transfer_params=decode_params(tid)
        )
        eng.scheduler.add_request(req)
        # The whole uncached prompt, loaded asynchronously.
        assert eng.connector.get_num_new_matched_tokens(req, 0) == (40, True)

        sched_out, _ = step(eng.scheduler)
        assert _status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert sched_out.total_num_scheduled_tokens == 0
        blocks = eng.blocks_of("d1")
        assert len(blocks) == 3  # 16 + 16 + 8 tokens
        meta = _meta(sched_out)
        assert meta.recv == [RecvSpec("d1", tid, of(blocks))]
        assert meta.fail == [] and meta.send == []
        assert meta.idle  # nothing was scheduled in this step

        # Registration runs on the client thread; the coordinator sees it soon.
        t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_REGISTERED))
        assert t.decode_engine_id == eng.engine_id
        assert [list(g.ids) for g in t.decode_blocks] == [blocks]
        assert t.num_tokens == 40
        # An accepted registration needs nothing from the engine thread: the
        # client thread drops its answer instead of queueing it. It stays open
        # (resubmitted after a failover) until the load ends.
        assert eng.client.wait_answered(1, DEADLINE_S)
        assert not eng.client.has_results()
        assert eng.client.open_transfers() == {tid}

        # Accepted: later steps carry nothing new and the request keeps waiting.
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).recv == [] and _meta(sched_out).fail == []
        assert _status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert [c.kind for c in eng.spy.calls] == ["register"]

        # The worker reports the KV in; the request runs its last prompt token.
        step(eng.scheduler, connector_output=kv_output(finished_recving={"d1"}))
        assert eng.client.wait_open(lambda open_: not open_, DEADLINE_S)  # settled
        sched_out, _ = step(eng.scheduler)
        assert _status(req) == RequestStatus.RUNNING
        assert sched_out.num_scheduled_tokens == {"d1": 1}
        assert _meta(sched_out).recv == []  # the second alloc registers nothing
        step(eng.scheduler)
        assert _status(req) == RequestStatus.FINISHED_LENGTH_CAPPED
        assert eng.spy.finished["d1"][2] == (False, None)
        assert [c.kind for c in eng.spy.calls] == ["register"]  # no Cancel after success


async def test_hybrid_groups_register_the_window_and_orders_pair_token_positions(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    """vLLM's hybrid KV cache manager with a full-attention and a 32-token
    sliding-window group (16-token blocks), 100-token prompt (7 blocks).

    What vLLM hands the connector, found here: on the decode side
    update_state_after_alloc's KVCacheBlocks holds, in the sliding-window group,
    vLLM's null block (id 0) for the blocks wholly before the window of the next
    token (get_num_skipped_tokens(100) = 100 - 32 + 1 = 69 tokens: 4 blocks) and
    new blocks for the other 3; on the prefill side request_finished_all_groups
    gets the same: null ids before the window. Both sides report per group the
    blocks they hold, a tail ending at the prompt's last block, and the
    coordinator's order writes each decode block from the prefill block of the
    same token positions, never a block decode does not hold."""
    n, window = 100, 32
    need = -(-n // BLOCK)  # 7
    skipped = (n - window + 1) // BLOCK  # 4
    prompt = prompt_tokens(n, seed=11)
    tid = new_tid()
    async with (
        engine(coord, tiny_model_dir, "kv_consumer", window=window) as dec,
        engine(coord, tiny_model_dir, "kv_producer", window=window) as pre,
    ):
        assert len(dec.scheduler.kv_cache_config.kv_cache_groups) == 2
        req = make_request(
            "dh", prompt, dec.config, max_tokens=2, kv_transfer_params=decode_params(tid)
        )
        dec.scheduler.add_request(req)
        assert dec.connector.get_num_new_matched_tokens(req, 0) == (n, True)
        sched_out, _ = step(dec.scheduler)
        assert _status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
        full_ids, window_ids = dec.scheduler.kv_cache_manager.get_block_ids("dh")
        assert len(full_ids) == need and 0 not in full_ids
        assert window_ids[:skipped] == [0] * skipped  # vLLM's null block
        assert len(window_ids) == need and 0 not in window_ids[skipped:]
        (reg,) = dec.spy.calls
        assert reg.kind == "register" and reg.num_tokens == n
        assert reg.blocks == of(full_ids, window_ids[skipped:])
        assert _meta(sched_out).recv == [RecvSpec("dh", tid, of(full_ids, window_ids[skipped:]))]
        t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_REGISTERED))
        assert [list(g.ids) for g in t.decode_blocks] == [full_ids, window_ids[skipped:]]

        preq = make_request(
            "ph", prompt, pre.config, max_tokens=1, kv_transfer_params=prefill_params(tid)
        )
        pre.scheduler.add_request(preq)
        sched_out, _ = step(pre.scheduler)
        assert _status(preq) == RequestStatus.FINISHED_LENGTH_CAPPED
        p_full, p_window = pre.spy.all_groups["ph"]
        assert len(p_full) == need and 0 not in p_full
        assert p_window[:skipped] == [0] * skipped and 0 not in p_window[skipped:need]
        done = next(c for c in pre.spy.calls if c.kind == "prefill_done")
        assert done.blocks == of(p_full[:need], p_window[skipped:need])
        assert pre.spy.finished["ph"][2] == (True, {"transfer_id": tid})

        # The order: group by group, decode's blocks from the same positions.
        assert pre.agent is not None
        order = await pre.agent.expect("order", skip=("peer",))
        (target,) = order.targets
        assert [list(g.ids) for g in target.src_blocks] == [p_full[:need], p_window[skipped:need]]
        assert [list(g.ids) for g in target.dst_blocks] == [full_ids, window_ids[skipped:]]


async def test_hybrid_prompt_whose_window_edge_vllm_frees_is_computed_by_decode(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    """47 tokens, 32-token window, 16-token blocks: vLLM frees the
    get_num_skipped_tokens(47) = 16 tokens before the window (block 0) on both
    engines, but the last prompt token vLLM recomputes after a load attends to
    token 15 in block 0. No transfer can serve it exactly, so the decode
    engine claims nothing, computes the prompt itself and cancels the transfer
    naming why (the prefill side then frees its blocks at once)."""
    tid = new_tid()
    async with engine(coord, tiny_model_dir, "kv_consumer", window=32) as dec:
        req = make_request(
            "de", prompt_tokens(47), dec.config, max_tokens=2, kv_transfer_params=decode_params(tid)
        )
        dec.scheduler.add_request(req)
        assert dec.connector.get_num_new_matched_tokens(req, 0) == (0, False)
        sched_out, _ = step(dec.scheduler)
        assert sched_out.num_scheduled_tokens == {"de": 47}  # computed here
        (cancel,) = dec.spy.calls
        assert cancel.kind == "cancel"
        assert "frees the block holding token 15 on both engines" in cancel.reason
        t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_CANCELLED))
        assert "decode computes this 47-token prompt itself" in t.detail
        assert _meta(sched_out).recv == []
        # 48 tokens: the window edge falls inside block 1, which both keep.
        assert dec.connector._scheduler is not None
        assert dec.connector._scheduler.window_edge(48) == ""
        assert dec.connector._scheduler.window_edge(31) == ""  # nothing freed


async def test_decode_with_local_prefix_hit_registers_only_the_tail(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    async with engine(coord, tiny_model_dir, "kv_consumer") as eng:
        prompt = prompt_tokens(40, seed=7)
        # A plain local request with the same prompt leaves two full blocks cached.
        warm = make_request("warm", prompt, eng.config, max_tokens=1)
        eng.scheduler.add_request(warm)
        step(eng.scheduler)
        assert _status(warm) == RequestStatus.FINISHED_LENGTH_CAPPED

        tid = new_tid()
        req = make_request(
            "d2", prompt, eng.config, max_tokens=1, kv_transfer_params=decode_params(tid)
        )
        eng.scheduler.add_request(req)
        sched_out, _ = step(eng.scheduler)
        assert _status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
        blocks = eng.blocks_of("d2")
        unhashed = eng.scheduler.kv_cache_manager.get_blocks("d2").get_unhashed_block_ids()
        assert len(blocks) == 3 and unhashed == blocks[2:]
        # Only the 8-token tail block is claimed and registered.
        assert req.num_computed_tokens == 40
        assert _meta(sched_out).recv == [RecvSpec("d2", tid, of(blocks[2:]))]
        t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_REGISTERED))
        assert [list(g.ids) for g in t.decode_blocks] == [blocks[2:]]
        assert t.num_tokens == 40


async def test_decode_abort_while_waiting_cancels_and_holds_blocks_until_recved(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    async with engine(coord, tiny_model_dir, "kv_consumer") as eng:
        assert eng.agent is not None
        free0 = num_free_blocks(eng.scheduler)
        tid = new_tid()
        req = make_request(
            "d3", prompt_tokens(40), eng.config, kv_transfer_params=decode_params(tid)
        )
        eng.scheduler.add_request(req)
        step(eng.scheduler)
        assert _status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
        blocks = eng.blocks_of("d3")
        await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_REGISTERED))

        eng.scheduler.finish_requests("d3", RequestStatus.FINISHED_ABORTED)
        status, finished_blocks, result = eng.spy.finished["d3"]
        assert status == RequestStatus.FINISHED_ABORTED
        assert finished_blocks == blocks and result == (False, None)
        t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_CANCELLED))
        assert t.reason == pb.REASON_CANCELLED
        assert "decode request aborted" in t.detail
        assert not t.write_may_land
        # The decode engine's agent is told, so its worker can report the id.
        notice = await eng.agent.expect("notice", skip=("peer",))
        assert notice.transfer_id == tid and notice.state == pb.TRANSFER_STATE_CANCELLED
        assert not notice.write_may_land

        # vLLM keeps the blocks while the load may still land, however many steps pass.
        for _ in range(3):
            step(eng.scheduler)
            assert "d3" in eng.scheduler.requests
            assert num_free_blocks(eng.scheduler) == free0 - 3
        assert eng.scheduler.has_requests()

        # What the worker reports once the agent says no WRITE can land (KV_FAILED):
        # finished AND failed, with the request's blocks as load errors.
        step(
            eng.scheduler,
            connector_output=kv_output(
                finished_recving={"d3"}, failed_recving={"d3"}, invalid_block_ids=blocks
            ),
        )
        assert "d3" not in eng.scheduler.requests
        assert num_free_blocks(eng.scheduler) == free0
        assert not eng.scheduler.has_requests()
        assert [c.kind for c in eng.spy.calls] == ["register", "cancel"]


@pytest.mark.parametrize("why", ["cancelled_first", "engine_not_registered"])
async def test_decode_registration_refused_fails_the_load(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path, why: str
) -> None:
    tid = new_tid()
    async with engine(
        coord, tiny_model_dir, "kv_consumer", register_agent=why == "cancelled_first"
    ) as eng:
        if why == "cancelled_first":
            await stubs.transfers.Cancel(
                pb.CancelRequest(transfer_id=tid, reason="client went away"), timeout=5
            )
        free0 = num_free_blocks(eng.scheduler)
        req = make_request(
            "d4", prompt_tokens(40), eng.config, kv_transfer_params=decode_params(tid)
        )
        eng.scheduler.add_request(req)
        sched_out, _ = step(eng.scheduler)
        spec = RecvSpec("d4", tid, of(eng.blocks_of("d4")))
        assert _meta(sched_out).recv == [spec]

        result = eng.wait_result("register")
        if why == "cancelled_first":
            assert result.ok and result.state == pb.TRANSFER_STATE_CANCELLED
        else:
            assert not result.ok and "FAILED_PRECONDITION" in result.error
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).fail == [spec]
        assert _meta(sched_out).recv == []
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).fail == []  # reported once

        # The worker turns `fail` into failed_recving + finished_recving: the request
        # errors out (default policy "fail") and its blocks are freed.
        _, outputs = step(
            eng.scheduler,
            connector_output=kv_output(failed_recving={"d4"}, finished_recving={"d4"}),
        )
        assert _status(req) == RequestStatus.FINISHED_ERROR
        (out,) = outputs[0].outputs
        assert str(out.finish_reason) == "error"
        assert "d4" not in eng.scheduler.requests
        assert num_free_blocks(eng.scheduler) == free0
        # The failed request also cancels the transfer (once: at the refusal,
        # or at its end), so a prefill side that reports later learns at once
        # that nobody will take its KV. A registration refused for want of
        # agents has ended the transfer at the coordinator already (FAILED,
        # controlplane/calls.py): the first end wins.
        assert [c.kind for c in eng.spy.calls] == ["register", "cancel"]
        if why == "engine_not_registered":
            t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_FAILED))
            assert t.reason == pb.REASON_AGENT_LOST
            assert t.detail.startswith("the decode registration was refused: decode_engine_id:")
        else:
            t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_CANCELLED))
            assert t.detail == "client went away"  # the first cancel wins


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_on_transfer_failure_sets_vllms_load_failure_policy(
    coord: CoordinatorProcess, tiny_model_dir: Path, policy: str
) -> None:
    """vLLM's scheduler reads kv_load_failure_policy after creating the connector:
    the connector's setting (recompute unless told) is the one it runs with."""
    cfg = make_vllm_config(
        tiny_model_dir,
        connector_module="pushkv.vllm_integration.connector",
        connector_name="PushKVConnector",
        kv_role="kv_consumer",
        engine_id=f"dec-{policy}",
        kv_connector_extra_config={"coordinator": coord.address, "routable": False}
        | ({} if policy == "recompute" else {"on_transfer_failure": policy}),
        kv_load_failure_policy="fail" if policy == "recompute" else "recompute",
        block_size=BLOCK,
    )
    sched = make_scheduler(cfg, num_blocks=64)
    try:
        assert cfg.kv_transfer_config.kv_load_failure_policy == policy
        assert sched.recompute_kv_load_failures is (policy == "recompute")
    finally:
        sched.shutdown()


def test_an_unknown_on_transfer_failure_is_refused() -> None:
    with pytest.raises(ValueError, match="on_transfer_failure: 'retry' is not one of"):
        ConnectorSettings.from_extra_config(
            {"coordinator": "127.0.0.1:1", "routable": False, "on_transfer_failure": "retry"}
        )


def test_the_removed_metrics_port_is_refused_naming_where_the_metrics_went() -> None:
    with pytest.raises(ValueError, match="metrics_port is gone: the connector's counters"):
        ConnectorSettings.from_extra_config({"coordinator": "127.0.0.1:1", "metrics_port": 9470})


def test_a_log_level_logging_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="log_level 'LOUD' is not one of"):
        ConnectorSettings.from_extra_config(
            {"coordinator": "127.0.0.1:1", "routable": False, "log_level": "LOUD"}
        )
    quiet = ConnectorSettings.from_extra_config(
        {"coordinator": "127.0.0.1:1", "routable": False, "log_level": "warning"}
    )
    assert quiet.log_level == "WARNING"


def test_a_negative_hang_dump_is_refused() -> None:
    for bad in ("-1", "inf", "nan", "1e12"):
        with pytest.raises(ValueError, match=r"hang_dump_s: .* is not within 0 \(off\) and"):
            ConnectorSettings.from_extra_config(
                {"coordinator": "127.0.0.1:1", "routable": False, "hang_dump_s": bad}
            )
    with pytest.raises(ValueError, match="hang_dump_s: bad value 'soon'"):
        ConnectorSettings.from_extra_config(
            {"coordinator": "127.0.0.1:1", "routable": False, "hang_dump_s": "soon"}
        )
    on = ConnectorSettings.from_extra_config(
        {"coordinator": "127.0.0.1:1", "routable": False, "hang_dump_s": "2.5"}
    )
    assert on.hang_dump_s == 2.5


async def test_failed_load_with_recompute_policy_recomputes_without_registering_again(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    async with engine(
        coord, tiny_model_dir, "kv_consumer", kv_load_failure_policy="recompute"
    ) as eng:
        tid = new_tid()
        await stubs.transfers.Cancel(pb.CancelRequest(transfer_id=tid, reason="gone"), timeout=5)
        req = make_request(
            "d6", prompt_tokens(40), eng.config, max_tokens=2, kv_transfer_params=decode_params(tid)
        )
        eng.scheduler.add_request(req)
        step(eng.scheduler)
        blocks = eng.blocks_of("d6")
        eng.wait_result("register")
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).fail == [RecvSpec("d6", tid, of(blocks))]
        step(
            eng.scheduler,
            connector_output=kv_output(
                finished_recving={"d6"}, failed_recving={"d6"}, invalid_block_ids=blocks
            ),
        )
        # Recomputed locally from scratch: the connector claims nothing this time.
        sched_out, _ = step(eng.scheduler)
        assert _status(req) == RequestStatus.RUNNING
        assert sched_out.num_scheduled_tokens == {"d6": 40}
        assert eng.connector.get_num_new_matched_tokens(req, 0) == (0, False)
        assert _meta(sched_out).recv == [] and _meta(sched_out).fail == []
        step(eng.scheduler)
        assert _status(req) == RequestStatus.FINISHED_LENGTH_CAPPED
        assert eng.spy.finished["d6"][2] == (False, None)
        assert [c.kind for c in eng.spy.calls] == ["register"]  # registered once only
        assert "d6" not in eng.scheduler.requests
        step(eng.scheduler)  # hands the finished id to the workers
        assert not eng.scheduler.has_requests()


async def test_decode_request_ended_before_scheduling_cancels_the_transfer(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    # E.g. the API server rejected the decode leg: vLLM adds and aborts a dummy
    # request with the same kv_transfer_params; it never gets blocks.
    async with engine(coord, tiny_model_dir, "kv_consumer") as eng:
        tid = new_tid()
        req = make_request(
            "d5", [0], eng.config, max_tokens=1, kv_transfer_params=decode_params(tid)
        )
        eng.scheduler.add_request(req)
        eng.scheduler.finish_requests("d5", RequestStatus.FINISHED_ABORTED)
        assert eng.spy.finished["d5"] == (RequestStatus.FINISHED_ABORTED, [], (False, None))
        assert [c.kind for c in eng.spy.calls] == ["cancel"]
        t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_CANCELLED))
        assert "decode request aborted before its KV arrived" in t.detail
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).recv == [] and _meta(sched_out).fail == []
        assert not eng.scheduler.has_requests()


# ---------------------------------------------------------------- prefill side


@pytest.mark.parametrize(
    "finish",
    [RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED],
    ids=["max_tokens_1", "eos"],
)
async def test_prefill_reports_done_and_holds_blocks_until_finished_sending(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path, finish: RequestStatus
) -> None:
    async with engine(coord, tiny_model_dir, "kv_producer") as eng:
        free0 = num_free_blocks(eng.scheduler)
        tid = new_tid()
        eos = finish == RequestStatus.FINISHED_STOPPED
        req = make_request(
            "p1",
            prompt_tokens(33),
            eng.config,
            max_tokens=8 if eos else 1,
            kv_transfer_params=prefill_params(tid),
            # The harness samples DEFAULT_SAMPLED_TOKEN: make it EOS.
            eos_token_id=DEFAULT_SAMPLED_TOKEN if eos else None,
        )
        eng.scheduler.add_request(req)
        assert eng.connector.get_num_new_matched_tokens(req, 0) == (0, False)
        sched_out, outputs = step(eng.scheduler)
        assert sched_out.num_scheduled_tokens == {"p1": 33}  # computed locally
        assert _status(req) == finish
        status, blocks, result = eng.spy.finished["p1"]
        assert status == finish
        assert len(blocks) == 3
        assert result == (True, {"transfer_id": tid})
        (out,) = outputs[0].outputs
        assert out.kv_transfer_params == {"transfer_id": tid}

        t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_PREFILL_DONE))
        assert t.prefill_engine_id == eng.engine_id
        assert [list(g.ids) for g in t.prefill_blocks] == [blocks]
        assert t.num_tokens == 33
        # Open at the client (resubmitted after a failover) while the blocks are held.
        assert eng.client.wait_open(lambda open_: open_ == {tid}, DEADLINE_S)

        # The next step tells the worker which blocks it holds for which transfer.
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).send == [("p1", tid)]
        assert "p1" in sched_out.finished_req_ids
        for _ in range(2):
            step(eng.scheduler)
            assert "p1" in eng.scheduler.requests
            assert num_free_blocks(eng.scheduler) == free0 - 3
        assert eng.scheduler.has_requests()

        step(eng.scheduler, connector_output=kv_output(finished_sending={"p1"}))
        assert "p1" not in eng.scheduler.requests
        assert num_free_blocks(eng.scheduler) == free0
        assert not eng.scheduler.has_requests()
        assert [c.kind for c in eng.spy.calls] == ["prefill_done"]
        assert eng.client.wait_open(lambda open_: not open_, DEADLINE_S)  # settled


@pytest.mark.parametrize("progressive", [False, True], ids=["whole", "progressive"])
async def test_aborted_prefill_leg_cancels_and_frees_at_once(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path, progressive: bool
) -> None:
    """Aborted mid-prefill: with no chunk fired vLLM frees the blocks at once;
    after a chunk's fire (progressive push) a WRITE may be reading them, so
    they stay held until the worker's agent frees them (`abort`)."""
    # 32 tokens per step: a 40-token prompt is still mid-prefill after one step.
    async with engine(
        coord,
        tiny_model_dir,
        "kv_producer",
        max_num_batched_tokens=32,
        progressive_push=str(progressive),
    ) as eng:
        free0 = num_free_blocks(eng.scheduler)
        tid = new_tid()
        req = make_request(
            "p2",
            prompt_tokens(40),
            eng.config,
            max_tokens=1,
            kv_transfer_params=prefill_params(tid),
        )
        eng.scheduler.add_request(req)
        sched_out, _ = step(eng.scheduler)
        assert _status(req) == RequestStatus.RUNNING
        assert req.num_computed_tokens == 32
        assert [f.final for f in _meta(sched_out).fire] == ([False] if progressive else [])

        eng.scheduler.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
        status, blocks, result = eng.spy.finished["p2"]
        assert status == RequestStatus.FINISHED_ABORTED
        assert len(blocks) == 2
        t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_CANCELLED))
        assert "prefill request ended without KV" in t.detail
        assert [c.kind for c in eng.spy.calls] == ["cancel"]
        sched_out, _ = step(eng.scheduler)
        if not progressive:
            assert result == (False, None)
            assert "p2" not in eng.scheduler.requests
            assert num_free_blocks(eng.scheduler) == free0
            assert _meta(sched_out).send == []
            return
        assert result == (True, {"transfer_id": tid})
        assert _meta(sched_out).send == [("p2", tid)] and _meta(sched_out).abort == [tid]
        assert num_free_blocks(eng.scheduler) == free0 - 2
        step(eng.scheduler, connector_output=kv_output(finished_sending={"p2"}))
        assert num_free_blocks(eng.scheduler) == free0


async def test_prefill_fires_in_the_step_that_computes_its_last_prompt_token(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    """Chunked prefill (32 tokens a step): the fire comes with the step whose
    forward computes token 40, naming every block of the prompt; the request's
    end then fires nothing again. (Progressive push off: no chunk fires.)"""
    async with engine(
        coord, tiny_model_dir, "kv_producer", max_num_batched_tokens=32, progressive_push="false"
    ) as eng:
        tid = new_tid()
        req = make_request(
            "pf",
            prompt_tokens(40),
            eng.config,
            max_tokens=1,
            kv_transfer_params=prefill_params(tid),
        )
        eng.scheduler.add_request(req)
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).fire == []  # 32 of 40 tokens
        assert _status(req) == RequestStatus.RUNNING
        held = eng.blocks_of("pf")
        sched_out, _ = step(eng.scheduler)
        [fire] = _meta(sched_out).fire
        assert fire.transfer_id == tid and fire.num_tokens == 40
        assert list(fire.blocks[0]) == held + eng.spy.finished["pf"][1][len(held) :]
        assert len(fire.blocks[0]) == 3
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).send == [("pf", tid)] and _meta(sched_out).fire == []


async def test_chunked_prefill_fires_each_chunks_whole_blocks_then_the_final(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    """Progressive push: 100 tokens in chunks of 32 with 16-token blocks: each
    step's fire names the tokens computed so far (2, 4, 6 whole blocks), and
    the step that computes token 100 fires the final."""
    async with engine(coord, tiny_model_dir, "kv_producer", max_num_batched_tokens=32) as eng:
        tid = new_tid()
        req = make_request(
            "pc",
            prompt_tokens(100),
            eng.config,
            max_tokens=1,
            kv_transfer_params=prefill_params(tid),
        )
        eng.scheduler.add_request(req)
        seen = []
        for _ in range(4):
            sched_out, _ = step(eng.scheduler)
            [f] = _meta(sched_out).fire
            seen.append((f.final, f.computed_tokens, len(f.blocks[0])))
            assert f.transfer_id == tid and f.num_tokens == 100
        assert seen == [(False, 32, 2), (False, 64, 4), (False, 96, 6), (True, 0, 7)]
        assert eng.spy.finished["pc"][2] == (True, {"transfer_id": tid})
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).fire == []  # fired already: no late fire


async def test_progressive_push_off_fires_once(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    async with engine(
        coord, tiny_model_dir, "kv_producer", max_num_batched_tokens=32, progressive_push="false"
    ) as eng:
        tid = new_tid()
        req = make_request(
            "pn",
            prompt_tokens(70),
            eng.config,
            max_tokens=1,
            kv_transfer_params=prefill_params(tid),
        )
        eng.scheduler.add_request(req)
        fires = []
        for _ in range(3):
            sched_out, _ = step(eng.scheduler)
            fires += _meta(sched_out).fire
        assert [(f.final, len(f.blocks[0])) for f in fires] == [(True, 5)]


async def test_a_leg_that_goes_on_decoding_fires_when_it_finishes(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    """max_tokens > 1: vLLM may preempt the request (and free its blocks)
    after its prompt, so it fires only from request_finished, once vLLM keeps
    the blocks for the transfer."""
    async with engine(coord, tiny_model_dir, "kv_producer") as eng:
        tid = new_tid()
        req = make_request(
            "pd",
            prompt_tokens(33),
            eng.config,
            max_tokens=2,
            kv_transfer_params=prefill_params(tid),
        )
        eng.scheduler.add_request(req)
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).fire == [] and _status(req) == RequestStatus.RUNNING
        step(eng.scheduler)  # its second token: finished
        assert eng.spy.finished["pd"][2] == (True, {"transfer_id": tid})
        sched_out, _ = step(eng.scheduler)
        [fire] = _meta(sched_out).fire
        assert fire.final and fire.num_tokens == 33
        assert list(fire.blocks[0]) == eng.spy.finished["pd"][1]
        assert _meta(sched_out).send == [("pd", tid)]


@pytest.mark.parametrize(
    "why", ["cancelled_first", "engine_not_registered", "agent_registered_as_decode"]
)
async def test_prefill_done_refused_frees_the_blocks_at_once(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path, why: str
) -> None:
    """No order will read the blocks and the agent is never told: free them now.

    A report refused for a reason other than missing agents (a configuration
    error: the engine's agent registered it as a decode engine) records
    nothing, so no WRITE will come: the connector also cancels, so the decode
    side already registered is told at once instead of holding its blocks to
    the rendezvous deadline."""
    tid = new_tid()
    decode_engine = f"dec-{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        dec = None
        if why == "agent_registered_as_decode":
            dec = SimAgent(coord.address, decode_engine, "decode", heartbeat_interval=0.5)
            await stack.enter_async_context(dec)
        eng = await stack.enter_async_context(
            engine(
                coord,
                tiny_model_dir,
                "kv_producer",
                register_agent=why != "engine_not_registered",
                agent_role="decode" if dec is not None else None,
            )
        )
        if why == "cancelled_first":  # e.g. the router cancelled: client gone
            await stubs.transfers.Cancel(
                pb.CancelRequest(transfer_id=tid, reason="client went away"), timeout=5
            )
        if dec is not None:
            await stubs.transfers.RegisterDecodeBlocks(
                pb.RegisterDecodeBlocksRequest(
                    transfer_id=tid,
                    decode_engine_id=decode_engine,
                    block_ids=[pb.BlockIds(ids=[1, 2, 3])],
                    num_tokens=33,
                ),
                timeout=5,
            )
        free0 = num_free_blocks(eng.scheduler)
        req = make_request(
            "p3",
            prompt_tokens(33),
            eng.config,
            max_tokens=1,
            kv_transfer_params=prefill_params(tid),
        )
        eng.scheduler.add_request(req)
        step(eng.scheduler)
        assert eng.spy.finished["p3"][2] == (True, {"transfer_id": tid})
        result = eng.wait_result("prefill_done")
        if why == "cancelled_first":
            assert result.ok and result.state == pb.TRANSFER_STATE_CANCELLED
            assert not result.write_may_land
        else:
            assert result.refused and "FAILED_PRECONDITION" in result.error
        if dec is not None:
            assert "registered as decode" in result.error

        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).send == [("p3", tid)]
        assert _meta(sched_out).free == [("p3", tid)]
        if dec is not None:
            assert [c.kind for c in eng.spy.calls] == ["prefill_done", "cancel"]
            t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_CANCELLED))
            assert t.detail.startswith("prefill report refused (FAILED_PRECONDITION:")
            assert t.detail.endswith("; decode computes it")
            # The decode engine's agent is told, so its side frees its blocks now.
            n = await dec.expect("notice", DEADLINE_S)
            assert (n.transfer_id, n.state) == (tid, pb.TRANSFER_STATE_CANCELLED)
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).free == []  # once
        step(eng.scheduler, connector_output=kv_output(finished_sending={"p3"}))
        assert "p3" not in eng.scheduler.requests
        assert num_free_blocks(eng.scheduler) == free0


async def test_accepted_prefill_done_is_not_freed_early(
    coord: CoordinatorProcess, stubs: Stubs, tiny_model_dir: Path
) -> None:
    async with engine(coord, tiny_model_dir, "kv_producer") as eng:
        tid = new_tid()
        req = make_request(
            "p4",
            prompt_tokens(20),
            eng.config,
            max_tokens=1,
            kv_transfer_params=prefill_params(tid),
        )
        eng.scheduler.add_request(req)
        step(eng.scheduler)
        # Accepted (the transfer waits for its decode side): nothing is queued.
        assert eng.client.wait_answered(1, DEADLINE_S)
        assert not eng.client.has_results()
        t = await wait_transfer(stubs, tid, in_state(pb.TRANSFER_STATE_PREFILL_DONE))
        assert [list(g.ids) for g in t.prefill_blocks] == [eng.blocks_of("p4")]
        sched_out, _ = step(eng.scheduler)
        assert _meta(sched_out).send == [("p4", tid)] and _meta(sched_out).free == []


# ---------------------------------------------------------------- other requests


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
async def test_requests_without_pushkv_params_are_untouched(
    coord: CoordinatorProcess, tiny_model_dir: Path, role: str
) -> None:
    async with engine(coord, tiny_model_dir, role) as eng:
        variants: list[dict[str, Any] | None] = [
            None,
            {"do_remote_prefill": True},  # no transfer id: not a pushkv transfer
            {"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "tx-1"},
            {"transfer_id": "tx-2"},
        ]
        reqs = [
            make_request(
                f"n{i}",
                prompt_tokens(24, seed=i),
                eng.config,
                max_tokens=2,
                kv_transfer_params=params,
            )
            for i, params in enumerate(variants)
        ]
        for r in reqs:
            eng.scheduler.add_request(r)
            assert eng.connector.get_num_new_matched_tokens(r, 0) == (0, False)
        free0 = num_free_blocks(eng.scheduler)
        for _ in range(2):
            sched_out, _ = step(eng.scheduler)
            meta = _meta(sched_out)
            assert meta.recv == [] and meta.fail == [] and meta.send == [] and meta.free == []
        assert sorted(sched_out.num_scheduled_tokens) == [f"n{i}" for i in range(len(reqs))]
        for r in reqs:
            assert _status(r) == RequestStatus.FINISHED_LENGTH_CAPPED
            assert eng.spy.finished[r.request_id][2] == (False, None)
            assert r.request_id not in eng.scheduler.requests
        assert num_free_blocks(eng.scheduler) == free0
        assert eng.spy.calls == []


async def test_unreachable_coordinator_fails_the_load_only_after_the_grace(
    tiny_model_dir: Path,
) -> None:
    """A registration whose outcome is unknown must not free blocks a WRITE may hit."""
    import socket
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = make_vllm_config(
        tiny_model_dir,
        connector_module="pushkv.vllm_integration.connector",
        connector_name="PushKVConnector",
        kv_role="kv_consumer",
        engine_id="dec-unreachable",
        kv_connector_extra_config={
            "coordinator": dead,
            "routable": False,
            "rpc_timeout_s": 0.3,
            "uncertain_grace_s": 1.0,
            "on_transfer_failure": "fail",
        },
        block_size=BLOCK,
    )
    sched = make_scheduler(cfg, num_blocks=64)
    eng = Engine("dec-unreachable", cfg, sched, None, Spy())
    _spy(eng.connector, eng.spy)
    try:
        tid = new_tid()
        req = make_request("u1", prompt_tokens(40), cfg, kv_transfer_params=decode_params(tid))
        sched.add_request(req)
        sched_out, _ = step(sched)
        spec = RecvSpec("u1", tid, of(eng.blocks_of("u1")))
        assert _meta(sched_out).recv == [spec]
        result = eng.wait_result("register")
        assert not result.ok and not result.refused and "UNAVAILABLE" in result.error
        failed_at = None
        started = time.monotonic()
        while time.monotonic() - started < DEADLINE_S:
            sched_out, _ = step(sched)
            if _meta(sched_out).fail:
                failed_at = time.monotonic() - started
                assert _meta(sched_out).fail == [spec]
                break
        assert failed_at is not None, "the load was never failed"
        assert failed_at >= 1.0, f"failed after {failed_at:.2f} s, before the grace"
        assert [c.kind for c in eng.spy.calls[:2]] == ["register", "cancel"]
        assert _status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
    finally:
        sched.shutdown()
