"""The connector's WORKER half with real agents: NIXL WRITEs between torch CPU caches.

Two ``PushWorkerHalf`` objects (a prefill and a decode "engine") live in the
test process, each with an embedded agent (NIXL thread + coordinator stream)
registered at a real coordinator process.  The test plays vLLM's model runner:
it hands the halves the per-step metadata the scheduler half would send and
calls ``get_finished`` the way the runner does every step.  The coordinator
RPCs of the scheduler half are made with plain gRPC stubs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from pushkv.agent.events import EventKind
from pushkv.agent.nixl_adapter import quiet_nixl_env
from pushkv.agent.nixl_types import KVRegion
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.rules.block_groups import of
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.compat import KVConnectorRole
from pushkv.vllm_integration.connector import PushKVConnector
from pushkv.vllm_integration.metadata import PushKVMetadata, RecvSpec
from pushkv.vllm_integration.settings import ConnectorSettings
from pushkv.vllm_integration.worker import (
    PushWorkerHalf,
    block_layout,
    distinct_regions,
    mla_block_layout,
    regions_of,
)
from tests.support.kvpair import wait_state
from tests.support.vllm_harness import make_kv_cache_config, make_vllm_config

NB = 32  # blocks per layer
HEADS, BLOCK, HEAD_DIM = 2, 16, 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
COMPAT = {"model": "tiny", "dtype": "float32", "block_size": "16"}
DEADLINE_S = 20.0


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def coord() -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess("--log-level", "WARNING").start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def nixl_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in quiet_nixl_env(loopback=True).items():
            mp.setenv(key, value)
        yield


@dataclass
class Stubs:
    transfers: pbg.TransferServiceStub
    status: pbg.StatusServiceStub


@pytest.fixture(scope="module")
def stubs(coord: CoordinatorProcess) -> Iterator[Stubs]:
    channel = grpc.insecure_channel(coord.address)
    yield Stubs(pbg.TransferServiceStub(channel), pbg.StatusServiceStub(channel))
    channel.close()


def cpu_caches(num_blocks: int = NB) -> dict[str, torch.Tensor]:
    """Per-layer caches shaped like vLLM's CPU backend: [blocks, heads, block, 2*head_dim]."""
    return {name: torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD_DIM) for name in LAYERS}


@dataclass
class Side:
    engine_id: str
    half: PushWorkerHalf
    caches: dict[str, torch.Tensor]


def start_half(coord: CoordinatorProcess, is_prefill: bool) -> Side:
    engine_id = f"{'P' if is_prefill else 'D'}-{uuid.uuid4().hex[:8]}"
    half = PushWorkerHalf(
        ConnectorSettings(coordinator=coord.address, register_timeout_s=30, routable=False),
        engine_id=engine_id,
        is_prefill=is_prefill,
        tp_rank=0,
        tp_size=1,
        tokens_per_block=BLOCK,
        num_blocks=NB,
        compat=COMPAT,
    )
    caches = cpu_caches()
    half.register_kv_caches(caches)
    assert half.agent is not None and half.agent.registered
    return Side(engine_id, half, caches)


@pytest.fixture(scope="module")
def pair(coord: CoordinatorProcess, nixl_env: None) -> Iterator[tuple[Side, Side]]:
    p = start_half(coord, is_prefill=True)
    try:
        d = start_half(coord, is_prefill=False)
    except BaseException:
        p.half.shutdown()
        raise
    yield p, d
    d.half.shutdown()
    p.half.shutdown()


def new_tid() -> str:
    return f"tx-{uuid.uuid4().hex}"


def register(stubs: Stubs, tid: str, engine: str, blocks: list[int], n: int) -> pb.TransferStatus:
    return stubs.transfers.RegisterDecodeBlocks(
        pb.RegisterDecodeBlocksRequest(
            transfer_id=tid,
            decode_engine_id=engine,
            block_ids=[pb.BlockIds(ids=blocks)],
            num_tokens=n,
        ),
        timeout=10,
    )


def prefill_done(
    stubs: Stubs, tid: str, engine: str, blocks: list[int], n: int
) -> pb.TransferStatus:
    return stubs.transfers.ReportPrefillDone(
        pb.ReportPrefillDoneRequest(
            transfer_id=tid,
            prefill_engine_id=engine,
            block_ids=[pb.BlockIds(ids=blocks)],
            num_tokens=n,
        ),
        timeout=10,
    )


@dataclass
class Finished:
    sending: list[str]
    recving: list[str]


def run_steps(sides: list[tuple[Side, set[str]]], until: Callable[[Finished], bool]) -> Finished:
    """Call get_finished on each half like consecutive idle engine steps, until `until`.

    Each side gets its own finished_req_ids (only on the first step, as vLLM
    passes each id once).  An idle step waits briefly on the agent's events.
    """
    seen = Finished([], [])
    deadline = time.monotonic() + DEADLINE_S
    first = True
    while not until(seen):
        assert time.monotonic() < deadline, f"not finished in {DEADLINE_S} s: {seen}"
        for side, finished_ids in sides:
            sending, recving = side.half.get_finished(finished_ids if first else set(), idle=True)
            seen.sending += sorted(sending or ())
            seen.recving += sorted(recving or ())
        first = False
    return seen


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def fill(caches: dict[str, torch.Tensor], blocks: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in caches.values():
        t[blocks] = torch.rand(len(blocks), *t.shape[1:], generator=g)


# ---------------------------------------------------------------- transfers


def test_push_lands_byte_for_byte_and_frees_after_finished(
    pair: tuple[Side, Side], stubs: Stubs
) -> None:
    p, d = pair
    tid = new_tid()
    src, dst = [3, 9, 4], [20, 7, 11]  # 40 tokens: 16 + 16 + 8
    fill(p.caches, src, seed=1)
    for t in d.caches.values():
        t.zero_()

    # Decode step after allocation: the scheduler half registered the blocks.
    d.half.start_load_kv(PushKVMetadata(recv=[RecvSpec("dreq", tid, of(dst))]))
    assert register(stubs, tid, d.engine_id, dst, 40).state == pb.TRANSFER_STATE_REGISTERED
    # Prefill: request_finished reported the blocks; the next step maps them and
    # carries the request id in finished_req_ids.
    assert prefill_done(stubs, tid, p.engine_id, src, 40).state == pb.TRANSFER_STATE_ORDERED
    p.half.start_load_kv(PushKVMetadata(send=[("preq", tid)]))

    seen = run_steps([(p, {"preq"}), (d, set())], until=lambda f: bool(f.recving and f.sending))
    assert seen.recving == ["dreq"] and seen.sending == ["preq"]
    for name in LAYERS:
        for s, t in zip(src, dst, strict=True):
            assert same_bytes(d.caches[name][t], p.caches[name][s]), (name, s, t)
        others = [b for b in range(NB) if b not in dst]
        assert not d.caches[name][others].any()  # nothing else was written
    assert d.half.take_failed() == set()
    assert d.half.get_block_ids_with_load_errors() == set()

    # Reported exactly once; a late `free` for the same request is ignored.
    p.half.start_load_kv(PushKVMetadata(free=[("preq", tid)]))
    for _ in range(3):
        assert p.half.get_finished({"preq"}, idle=False) == (None, None)
        assert d.half.get_finished(set(), idle=False) == (None, None)
    # The decode rank tells its host KV_READY before it sends the arrival that
    # completes the transfer, so the coordinator may lag the host by a message.
    t = wait_state(stubs.status, tid, pb.TRANSFER_STATE_COMPLETE)
    assert t.state == pb.TRANSFER_STATE_COMPLETE and not t.write_may_land
    # The connector counted the real events (what vLLM's /metrics adds up:
    # tests/test_connector_stats.py).
    assert d.half.counts.ready == 1
    assert d.half.counts.events[EventKind.KV_READY] == 1
    assert p.half.counts.freed == 1


def test_prefill_frees_only_after_its_id_was_finished(
    pair: tuple[Side, Side], stubs: Stubs
) -> None:
    """BLOCKS_FREE arriving before the send mapping, and before vLLM finished the id."""
    p, d = pair
    assert p.half.agent is not None
    tid = new_tid()
    src, dst = [1, 2], [30, 31]
    fill(p.caches, src, seed=2)
    d.half.start_load_kv(PushKVMetadata(recv=[RecvSpec("dreq2", tid, of(dst))]))
    register(stubs, tid, d.engine_id, dst, 20)
    prefill_done(stubs, tid, p.engine_id, src, 20)
    assert run_steps([(d, set())], until=lambda f: bool(f.recving)).recving == ["dreq2"]

    # The agent's BLOCKS_FREE comes before the worker knows the transfer.
    e = p.half.agent.wait_event(DEADLINE_S)
    assert e is not None and (e.kind, e.transfer_id) == (EventKind.BLOCKS_FREE, tid)
    p.half.agent._events.appendleft(e)  # leave it for the worker to pick up
    assert p.half.get_finished(set(), idle=False) == (None, None)

    p.half.start_load_kv(PushKVMetadata(send=[("preq2", tid)]))
    assert p.half.get_finished(set(), idle=False) == (None, None)  # not finished in vLLM yet
    assert p.half.get_finished({"preq2"}, idle=False) == ({"preq2"}, None)
    assert p.half.get_finished({"preq2"}, idle=False) == (None, None)
    for name in LAYERS:
        assert same_bytes(d.caches[name][dst], p.caches[name][src])


def test_free_from_scheduler_releases_held_blocks(pair: tuple[Side, Side]) -> None:
    """The scheduler half learned the transfer had ended: free without an agent event."""
    p, _ = pair
    tid = new_tid()
    p.half.start_load_kv(PushKVMetadata(send=[("preq3", tid)], free=[("preq3", tid)]))
    assert p.half.get_finished({"preq3"}, idle=False) == ({"preq3"}, None)
    assert p.half.get_finished(set(), idle=False) == (None, None)


def test_unrelated_finished_ids_are_not_kept(pair: tuple[Side, Side]) -> None:
    p, d = pair
    for side in (p, d):
        ids = {f"other-{i}" for i in range(100)}
        assert side.half.get_finished(ids, idle=False) == (None, None)
        assert not side.half._sched_finished & ids


# ---------------------------------------------------------------- failures (connector facade)


@pytest.fixture
def decode_connector(
    coord: CoordinatorProcess, nixl_env: None, tiny_model_dir: Path
) -> Iterator[tuple[PushKVConnector, str]]:
    engine_id = f"D-{uuid.uuid4().hex[:8]}"
    cfg = make_vllm_config(
        tiny_model_dir,
        connector_module="pushkv.vllm_integration.connector",
        connector_name="PushKVConnector",
        kv_role="kv_consumer",
        engine_id=engine_id,
        kv_connector_extra_config={
            "coordinator": coord.address,
            "register_timeout_s": 30,
            "routable": False,  # in process: no HTTP server
        },
        block_size=BLOCK,
    )
    kv_cache_config = make_kv_cache_config(cfg, num_blocks=NB)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    conn = PushKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
    caches = {
        name: torch.zeros(NB, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
        for name in kv_cache_config.kv_cache_groups[0].layer_names
    }
    conn.register_kv_caches(caches)
    yield conn, engine_id
    conn.shutdown()


@dataclass
class StepResult:
    finished_recving: set[str]
    failed_recving: set[str]
    load_errors: set[int]


def worker_step(conn: PushKVConnector, meta: PushKVMetadata) -> StepResult:
    """One model-runner step of the worker connector (kv_connector_no_forward order)."""
    conn.bind_connector_metadata(meta)
    try:
        conn.start_load_kv(None)
        conn.wait_for_save()
        res = conn.get_transfer_results(set())
        errors = conn.get_block_ids_with_load_errors()
    finally:
        conn.clear_connector_metadata()
    assert not res.finished_sending
    return StepResult(set(res.finished_recving), set(res.failed_recving), errors)


def test_cancelled_transfer_fails_the_load_with_its_blocks(
    decode_connector: tuple[PushKVConnector, str], stubs: Stubs
) -> None:
    conn, engine_id = decode_connector
    tid = new_tid()
    blocks = (5, 6, 7)
    r = worker_step(conn, PushKVMetadata(recv=[RecvSpec("dfail", tid, of(blocks))], idle=True))
    assert r == StepResult(set(), set(), set())
    assert register(stubs, tid, engine_id, list(blocks), 40).state == (pb.TRANSFER_STATE_REGISTERED)
    cancelled = stubs.transfers.Cancel(
        pb.CancelRequest(transfer_id=tid, reason="router gave up"), timeout=5
    )
    assert cancelled.state == pb.TRANSFER_STATE_CANCELLED

    deadline = time.monotonic() + DEADLINE_S
    while not (r := worker_step(conn, PushKVMetadata(idle=True))).finished_recving:
        assert time.monotonic() < deadline, "the failed load was never reported"
    # Same step: finished AND failed (vLLM's aggregator needs both), and the blocks.
    assert r == StepResult({"dfail"}, {"dfail"}, set(blocks))
    half = conn._worker
    assert half is not None
    assert half.counts.failed == 1
    assert half.counts.load_error_blocks == len(blocks)
    # on_transfer_failure=recompute (the default): vLLM recomputes it, counted as such.
    assert half.counts.fallbacks["transfer_failed"] == 1
    for _ in range(3):  # reported once
        assert worker_step(conn, PushKVMetadata(idle=True)) == StepResult(set(), set(), set())


def test_refused_registration_fails_the_load_in_the_same_step(
    decode_connector: tuple[PushKVConnector, str],
) -> None:
    conn, engine_id = decode_connector
    assert conn._worker is not None
    fallbacks = conn._worker.counts.fallbacks
    before = fallbacks["registration_failed"]
    tid = new_tid()
    spec = RecvSpec("dref", tid, of((8, 9)))
    assert worker_step(conn, PushKVMetadata(recv=[spec])) == StepResult(set(), set(), set())
    r = worker_step(conn, PushKVMetadata(fail=[spec]))
    assert r == StepResult({"dref"}, {"dref"}, {8, 9})
    assert worker_step(conn, PushKVMetadata()) == StepResult(set(), set(), set())
    assert fallbacks["registration_failed"] == before + 1
    # What vLLM takes after a step: what the rank counted since it last
    # answered (here: since the connector was built, every count so far).
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data["engine_id"] == engine_id
    assert stats.data["ranks"]["0"]["fallback:registration_failed"] == before + 1
    again = conn.get_kv_connector_stats()  # nothing counted since (but schedstat, maybe)
    assert again is None or set(again.data["ranks"]["0"]) <= {"run_ns", "wait_ns"}


# ---------------------------------------------------------------- regions_of


def test_regions_of_block_major_layout() -> None:
    caches = cpu_caches()
    regions = regions_of(caches, NB)
    block_len = HEADS * BLOCK * 2 * HEAD_DIM * 4
    assert regions == tuple(KVRegion(caches[n].data_ptr(), block_len, NB, 0) for n in LAYERS)


def test_regions_of_views_into_one_allocation() -> None:
    # vLLM CPU: every layer is a view into one storage, layer l at base + l * size.
    per_layer = NB * HEADS * BLOCK * 2 * HEAD_DIM
    storage = torch.zeros(2 * per_layer)
    caches = {
        # Named so that sorting puts layer 1 first: regions follow sorted names.
        "b.layer0": storage[:per_layer].view(NB, HEADS, BLOCK, 2 * HEAD_DIM),
        "a.layer1": storage[per_layer:].view(NB, HEADS, BLOCK, 2 * HEAD_DIM),
    }
    base, block_len = storage.data_ptr(), HEADS * BLOCK * 2 * HEAD_DIM * 4
    assert regions_of(caches, NB) == (
        KVRegion(base + per_layer * 4, block_len, NB, 0),
        KVRegion(base, block_len, NB, 0),
    )


def test_regions_of_kv_split_layout() -> None:
    # FlashAttention: [2, num_blocks, block, heads, head_dim]: K and V regions per layer.
    caches = {n: torch.zeros(2, NB, BLOCK, HEADS, HEAD_DIM) for n in LAYERS}
    block_len = BLOCK * HEADS * HEAD_DIM * 4
    expected = []
    for n in LAYERS:
        base = caches[n].data_ptr()
        expected += [
            KVRegion(base, block_len, NB, 0),
            KVRegion(base + NB * block_len, block_len, NB, 0),
        ]
    assert regions_of(caches, NB) == tuple(expected)
    # Block b of the V region is where torch puts caches[n][1, b].
    v = regions_of(caches, NB)[1]
    assert v.base_addr + 5 * v.block_len == caches[LAYERS[0]][1, 5].data_ptr()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(NB, HEADS, BLOCK, 4 * HEAD_DIM)[:, :, :, ::2],  # strided inner dims
        lambda: torch.zeros(HEADS, NB, BLOCK, 2 * HEAD_DIM).transpose(0, 1),  # blocks not outer
        lambda: torch.zeros(NB + 1, HEADS, BLOCK, 2 * HEAD_DIM)[1:].transpose(2, 3),
    ],
    ids=["strided", "transposed", "permuted-view"],
)
def test_regions_of_rejects_non_contiguous_blocks(make: Callable[[], torch.Tensor]) -> None:
    t = make()
    assert not t.is_contiguous()
    with pytest.raises(ValueError, match="not contiguous"):
        regions_of({"layer": t}, NB)


def test_regions_of_needs_a_block_dimension() -> None:
    with pytest.raises(ValueError, match=f"no dimension of size {NB}"):
        regions_of({"layer": torch.zeros(NB - 1, HEADS, BLOCK, 2 * HEAD_DIM)}, NB)


# ---------------------------------------------------------------- KV cache groups


def hybrid_caches(storage: torch.Tensor) -> dict[str, torch.Tensor]:
    """What vLLM's hybrid KV cache manager hands a CPU worker for 4 layers in 2
    groups (full attention: layers 1, 3; sliding window: layers 0, 2): one
    allocation, layer j of each group in slot j, so layers 0 and 1 alias one
    region and layers 2 and 3 the other (block ids are unique across groups)."""
    per_layer = NB * HEADS * BLOCK * 2 * HEAD_DIM
    slot = [
        storage[i * per_layer : (i + 1) * per_layer].view(NB, HEADS, BLOCK, 2 * HEAD_DIM)
        for i in (0, 1)
    ]
    return {f"model.layers.{i}.self_attn.attn": slot[i // 2] for i in range(4)}


def test_distinct_regions_lists_aliased_layers_once() -> None:
    storage = torch.zeros(2 * NB * HEADS * BLOCK * 2 * HEAD_DIM)
    regions = regions_of(hybrid_caches(storage), NB)
    assert len(regions) == 4
    assert distinct_regions(regions) == (regions[0], regions[2])
    assert distinct_regions(regions[:1]) == regions[:1]


def test_groups_of_a_hybrid_model_land_byte_for_byte(
    coord: CoordinatorProcess, nixl_env: None, stubs: Stubs
) -> None:
    """Two KV cache groups end to end through real agents and NIXL: each
    group's decode blocks get the prefill blocks of the same token positions
    (the sliding-window group only its window's tail), in every aliased layer
    slot, and no other decode block is written."""
    sides = []
    for is_prefill in (True, False):
        engine_id = f"{'P' if is_prefill else 'D'}-{uuid.uuid4().hex[:8]}"
        half = PushWorkerHalf(
            ConnectorSettings(coordinator=coord.address, register_timeout_s=30, routable=False),
            engine_id=engine_id,
            is_prefill=is_prefill,
            tp_rank=0,
            tp_size=1,
            tokens_per_block=BLOCK,
            num_blocks=NB,
            compat=COMPAT,
            kv_groups=2,
        )
        storage = torch.zeros(2 * NB * HEADS * BLOCK * 2 * HEAD_DIM)
        caches = hybrid_caches(storage)
        half.register_kv_caches(caches)
        assert half.agent is not None and half.agent.registered
        sides.append(Side(engine_id, half, caches))
    p, d = sides
    try:
        engines = {
            e.engine_id: e
            for e in stubs.status.ListEngines(pb.ListEnginesRequest(), timeout=10).engines
        }
        block_len = HEADS * BLOCK * 2 * HEAD_DIM * 4
        assert [(r.group, r.block_len) for r in engines[d.engine_id].kv.regions] == [
            (0, block_len),
            (0, block_len),
            (1, block_len),
            (1, block_len),
        ]
        tid = new_tid()
        # 80 tokens: 5 blocks of 16; the window group holds its last 2 on both sides.
        src = ([3, 9, 4, 5, 6], [12, 13])
        dst = ([20, 7, 11, 21, 22], [25, 26])
        fill(p.caches, [b for g in src for b in g], seed=3)
        d.half.start_load_kv(PushKVMetadata(recv=[RecvSpec("dreq", tid, of(*dst))]))
        reply = stubs.transfers.RegisterDecodeBlocks(
            pb.RegisterDecodeBlocksRequest(
                transfer_id=tid,
                decode_engine_id=d.engine_id,
                block_ids=[pb.BlockIds(ids=g) for g in dst],
                num_tokens=80,
            ),
            timeout=10,
        )
        assert reply.state == pb.TRANSFER_STATE_REGISTERED
        reply = stubs.transfers.ReportPrefillDone(
            pb.ReportPrefillDoneRequest(
                transfer_id=tid,
                prefill_engine_id=p.engine_id,
                block_ids=[pb.BlockIds(ids=g) for g in src],
                num_tokens=80,
            ),
            timeout=10,
        )
        assert reply.state == pb.TRANSFER_STATE_ORDERED
        p.half.start_load_kv(PushKVMetadata(send=[("preq", tid)]))
        seen = run_steps([(p, {"preq"}), (d, set())], until=lambda f: bool(f.recving and f.sending))
        assert seen.recving == ["dreq"] and seen.sending == ["preq"]
        for name in d.caches:  # all 4 layers: both aliased slots
            written = [b for g in dst for b in g]
            for s, t in zip([b for g in src for b in g], written, strict=True):
                assert same_bytes(d.caches[name][t], p.caches[name][s]), (name, s, t)
            others = [b for b in range(NB) if b not in written]
            assert not d.caches[name][others].any()
        status = wait_state(stubs.status, tid, pb.TRANSFER_STATE_COMPLETE)
        assert status.state == pb.TRANSFER_STATE_COMPLETE
    finally:
        d.half.shutdown()
        p.half.shutdown()


@pytest.mark.parametrize("kv_groups", [1, 2])
def test_a_failed_load_names_block_ids_only_with_one_kv_group(kv_groups: int) -> None:
    """vLLM raises on invalid_block_ids with several KV cache groups (its block
    ids are unique only per group): the worker then reports the request in
    failed_recving only, and vLLM applies kv_load_failure_policy to it."""
    half = PushWorkerHalf(
        ConnectorSettings(coordinator="127.0.0.1:9", routable=False),
        engine_id="D-groups",
        is_prefill=False,
        tp_rank=0,
        tp_size=1,
        tokens_per_block=BLOCK,
        num_blocks=NB,
        kv_groups=kv_groups,
    )
    blocks = of((4, 5, 9)) if kv_groups == 1 else of((4, 5), (9,))
    spec = RecvSpec("dreq", new_tid(), blocks)
    half.start_load_kv(PushKVMetadata(recv=[spec]))
    half.start_load_kv(PushKVMetadata(fail=[spec]))
    assert half.get_finished(set(), idle=False) == (None, {"dreq"})
    assert half.take_failed() == {"dreq"}
    assert half.get_block_ids_with_load_errors() == ({4, 5, 9} if kv_groups == 1 else set())
    half.shutdown()


# ---------------------------------------------------------------- MLA


LATENT = 576  # MLA: kv_lora_rank 512 + rope 64, one latent per token


@pytest.mark.parametrize(
    ("shape", "described"),
    [((NB, 1, BLOCK, LATENT), f"B,1,N,L{LATENT}"), ((NB, BLOCK, LATENT), f"B,N,L{LATENT}")],
    ids=["vllm-cpu", "no-heads-dim"],
)
def test_mla_layer_is_one_latent_region_of_whole_blocks(
    shape: tuple[int, ...], described: str
) -> None:
    """vLLM's CPU MLA cache: per layer [blocks, 1, tokens, latent], no K/V split:
    one region per layer, a block = BLOCK x 576 x 4 bytes, one contiguous span."""
    caches = {n: torch.zeros(shape) for n in LAYERS}
    assert mla_block_layout(caches, NB, BLOCK, LATENT) == (described, True)
    block_len = BLOCK * LATENT * 4
    regions = regions_of(caches, NB)
    assert regions == tuple(KVRegion(caches[n].data_ptr(), block_len, NB, 0) for n in LAYERS)
    r = regions[0]
    assert r.base_addr + 7 * r.block_len == caches[LAYERS[0]][7].data_ptr()
    # The per-head description would not say it is MLA's latent.
    assert block_layout(caches, NB, 1, BLOCK)[0] != described


@pytest.mark.parametrize(
    "shape",
    [
        (NB, 2, BLOCK, LATENT),
        (2, NB, BLOCK, LATENT),
        (NB, BLOCK, 512),
        (2 * NB, BLOCK // 2, LATENT),
    ],
    ids=["heads-dimension", "kv-split", "latent-width", "kernel-blocks"],
)
def test_mla_layout_refuses_a_shape_it_cannot_describe(shape: tuple[int, ...]) -> None:
    caches = {n: torch.zeros(shape) for n in LAYERS}
    with pytest.raises(ValueError, match="MLA KV tensor of shape"):
        mla_block_layout(caches, NB, BLOCK, LATENT)


def test_mla_worker_registers_the_latent_layout(coord: CoordinatorProcess, nixl_env: None) -> None:
    half = PushWorkerHalf(
        ConnectorSettings(coordinator=coord.address, register_timeout_s=30, routable=False),
        engine_id=f"D-mla-{uuid.uuid4().hex[:8]}",
        is_prefill=False,
        tp_rank=0,
        tp_size=1,
        tokens_per_block=BLOCK,
        num_blocks=NB,
        compat={**COMPAT, "mla": "True"},
        kv_heads=1,
        mla_head_size=LATENT,
    )
    try:
        half.register_kv_caches({n: torch.zeros(NB, 1, BLOCK, LATENT) for n in LAYERS})
        assert half.agent is not None and half.agent.registered
        cfg = half.agent.config
        assert dict(cfg.compat)["kv_layout"] == f"B,1,N,L{LATENT}"
        assert cfg.head_major and cfg.kv_heads == 1
        assert [r.block_len for r in cfg.regions] == [BLOCK * LATENT * 4] * len(LAYERS)
    finally:
        half.shutdown()
