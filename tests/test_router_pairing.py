"""The router pairs only engines the coordinator would accept (pushkv/rules/pairing.py).

A mixed cluster, as in tests/test_router.py: a real coordinator process, the
ranks of each engine as ``SimAgent``s whose hellos carry their KV layouts, and
stand-in HTTP engines that take each leg as the connector would (the decode
engine registers its blocks, the prefill engine reports its prompt done), so
every routed transfer meets at the coordinator, which refuses a pair it cannot
serve (FAILED/MISMATCH) and orders the prefill ranks otherwise; the prefill
SimAgents complete their orders and the decode ranks report each arrival.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.router.app import Router, RouterSettings
from pushkv.router.engines import EngineDirectory
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimAgent, blocks, serving, wait_terminal
from tests.test_router import COMPLETIONS, FakeEngine, completion, sample, wait

# These stand-in engines answer the concurrent-dispatch flow (both legs at once,
# the first token from the decode engine); tests/test_router_first_token.py
# covers the default, the first token from the prefill.
_DECODE_FIRST: dict[str, Any] = {"first_token": "decode"}

HEAD = 4096  # bytes of one KV head in one block (K or V region)
HEADS = 4  # the model's KV heads
TINY = {"model": "tiny", "dtype": "float32", "head_size": "32", "num_kv_heads": str(HEADS)}
OTHER = TINY | {"model": "other"}
TOKENS = 40  # 3 blocks of 16


@dataclass(frozen=True)
class Spec:
    engine_id: str
    role: str
    tp: int
    compat: dict[str, str]
    head_major: bool = True


def kv_layout(spec: Spec, rank: int) -> pb.KVLayout:
    per = HEADS // spec.tp
    base = 0x10_0000_0000 * (rank + 1)
    return pb.KVLayout(
        tokens_per_block=16,
        regions=[
            pb.KVRegion(base_addr=base + i * (1 << 30), block_len=per * HEAD, num_blocks=1024)
            for i in range(2)
        ],
        memory_kind="DRAM",
        compat=spec.compat,
        kv_heads=per,
        head_major=spec.head_major,
    )


# Prefill: TP1 and TP2 of the decode engine's model (both pairable with a TP2
# decode), the same model in a block layout that is not head-major (pairable
# only at equal TP), and another model at TP2 (never pairable here).
P_TP1 = Spec("p-tp1", "prefill", 1, TINY)
P_TP2 = Spec("p-tp2", "prefill", 2, TINY)
P_NHD = Spec("p-nhd", "prefill", 1, TINY, head_major=False)
P_OTHER = Spec("p-other", "prefill", 2, OTHER)
D_TP2 = Spec("d-tp2", "decode", 2, TINY)
COMPATIBLE = {("p-tp1", "d-tp2"), ("p-tp2", "d-tp2")}


@pytest.fixture
def coord() -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess("--log-level", "WARNING").start()
    yield c
    c.stop()


@dataclass
class Mixed:
    router: Router
    url: str
    http: aiohttp.ClientSession
    channel: grpc.aio.Channel
    engines: dict[str, FakeEngine]


@asynccontextmanager
async def mixed(
    coord: CoordinatorProcess,
    specs: list[Spec],
    hold: int = 0,
    on_transfer_failure: str = "",
    **settings: Any,
) -> AsyncIterator[Mixed]:
    """Each spec's ranks registered, its stand-in engine behind its api_url
    (every engine publishing `on_transfer_failure`), the router in process.
    Decode legs are held until `hold` of them have arrived (so that the
    router's load counts hold every request at once)."""
    channel = grpc.aio.insecure_channel(coord.address)
    transfers = pbg.TransferServiceStub(channel)
    slot: dict[str, int] = {}
    slots = itertools.count()
    decode_legs = 0
    all_held = asyncio.Event()

    def blocks_of(tid: str, base: int) -> list[pb.BlockIds]:
        i = slot.setdefault(tid, next(slots))
        return blocks(range(base + 3 * i, base + 3 * i + 3))

    async def prefill(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        tid = body["kv_transfer_params"]["transfer_id"]
        await transfers.ReportPrefillDone(
            pb.ReportPrefillDoneRequest(
                transfer_id=tid,
                prefill_engine_id=engine.name,
                block_ids=blocks_of(tid, 0),
                num_tokens=TOKENS,
            )
        )
        return web.json_response(completion(engine.name))

    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        nonlocal decode_legs
        params = body.get("kv_transfer_params")
        if params is not None:
            await transfers.RegisterDecodeBlocks(
                pb.RegisterDecodeBlocksRequest(
                    transfer_id=params["transfer_id"],
                    decode_engine_id=engine.name,
                    block_ids=blocks_of(params["transfer_id"], 512),
                    num_tokens=TOKENS,
                )
            )
        decode_legs += 1
        if decode_legs >= hold:
            all_held.set()
        await wait(all_held, f"{hold} decode legs held at once")
        return web.json_response(completion(engine.name))

    engines: dict[str, FakeEngine] = {}
    agents: list[SimAgent] = []
    runner: web.AppRunner | None = None
    try:
        for spec in specs:
            eng = await FakeEngine(
                spec.engine_id, prefill if spec.role == "prefill" else decode
            ).start()
            engines[spec.engine_id] = eng
            for r in range(spec.tp):
                agent = SimAgent(
                    coord.address,
                    spec.engine_id,
                    spec.role,
                    r,
                    spec.tp,
                    auto_complete=spec.role == "prefill",
                    heartbeat_interval=0.5,
                    kv_layout=kv_layout(spec, r),
                )
                serving(agent.hello, eng.url, on_transfer_failure)
                agents.append(agent)
        peers = {a.key: a for a in agents if a.role == pb.ROLE_DECODE}
        for a in agents:
            a.arrival_peers = peers
        await asyncio.gather(*(a.start() for a in agents))
        router = Router(
            RouterSettings(coordinator=coord.address, port=0, **{**_DECODE_FIRST, **settings})
        )
        runner = web.AppRunner(router.app(), handler_cancellation=True)
        await runner.setup()  # the first ListEngines: every engine is ready by now
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as http:
            yield Mixed(router, f"http://{host}:{port}", http, channel, engines)
    finally:
        if runner is not None:
            await runner.cleanup()
        for eng in engines.values():
            await eng.stop()
        await asyncio.gather(*(a.close() for a in agents))
        await channel.close(None)


async def test_a_mixed_cluster_routes_every_request_to_a_compatible_pair(
    coord: CoordinatorProcess,
) -> None:
    n = 12
    async with mixed(coord, [P_TP1, P_TP2, P_NHD, P_OTHER, D_TP2], hold=n) as m:
        pairs = {(p.engine_id, d.engine_id) for p, d in m.router.directory.pairs}
        assert pairs == COMPATIBLE

        async def one(i: int) -> None:
            body = {"prompt": f"request {i}", "max_tokens": 4}
            async with m.http.post(m.url + COMPLETIONS, json=body) as resp:
                assert resp.status == 200, await resp.text()

        await asyncio.gather(*(one(i) for i in range(n)))

        legs = {
            leg.request_id: (name, leg)
            for name, eng in m.engines.items()
            for leg in eng.legs
            if eng.name.startswith("p-")
        }
        assert len(legs) == n
        used = {(legs[leg.request_id][0], "d-tp2") for leg in m.engines["d-tp2"].legs}
        # Every request went to a compatible pair, and load spread over both.
        assert used == COMPATIBLE
        for name in ("p-nhd", "p-other"):
            assert m.engines[name].legs == []

        # The coordinator accepted every pairing: each transfer COMPLETE, every
        # prefill rank done and arrived at the decode ranks it wrote.
        done = await wait_terminal(m.channel, list(legs), timeout=10.0)
        for tid, t in done.items():
            assert t.state == pb.TRANSFER_STATE_COMPLETE, (tid, t.reason, t.detail)
            p_tp = 1 if t.prefill_engine_id == "p-tp1" else 2
            assert [r.prefill_rank for r in t.ranks] == list(range(p_tp))
            assert all(r.state == pb.RANK_STATE_DONE and r.arrived for r in t.ranks)
            assert list(t.outstanding_ranks) == []


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_no_compatible_pair_is_served_by_decode_alone_or_503(
    coord: CoordinatorProcess, policy: str
) -> None:
    async with mixed(coord, [P_NHD, P_OTHER, D_TP2], hold=1, on_transfer_failure=policy) as m:
        assert m.router.directory.pairs == []
        unpaired = m.router.directory.unpaired
        assert "p-other -> d-tp2: model differs: prefill 'other', decode 'tiny'" in unpaired
        assert "p-nhd -> d-tp2: prefill TP 1 into decode TP 2: needs a head-major" in unpaired
        async with m.http.get(m.url + "/health") as resp:
            assert resp.status == 503
            assert (await resp.json())["unpaired"] == unpaired
        async with m.http.post(m.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            if policy == "recompute":
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["text"] == "d-tp2"
            else:
                assert resp.status == 503
                err = (await resp.json())["error"]
                assert err["stage"] == "no_engine"
                assert "no prefill engine can push into a decode engine" in err["message"]
                assert "model differs" in err["message"]
        for name in ("p-nhd", "p-other"):
            assert m.engines[name].legs == []
        served = 1 if policy == "recompute" else 0
        assert len(m.engines["d-tp2"].legs) == served
        if served:
            assert "kv_transfer_params" not in m.engines["d-tp2"].legs[0].body
        fallbacks = sample(m, "pushkv_router_fallbacks_total", reason="no_compatible_prefill")
        assert fallbacks == served


def status(engine_id: str, role: int, tp: int, spec: Spec, inflight: int = 0) -> pb.EngineStatus:
    layout = kv_layout(spec, 0)
    return pb.EngineStatus(
        engine_id=engine_id,
        role=role,  # type: ignore[arg-type]
        tp_size=tp,
        ready=True,
        inflight_transfers=inflight,
        tokens_per_block=16,
        api_url=f"http://{engine_id}",
        kv=pb.KVShape(
            compat=layout.compat,
            kv_heads=layout.kv_heads,
            head_major=layout.head_major,
            regions=[pb.RegionShape(group=r.group, block_len=r.block_len) for r in layout.regions],
        ),
    )


def test_the_least_loaded_compatible_pair_is_picked() -> None:
    d = EngineDirectory(stub=None)  # type: ignore[arg-type]
    d.update(
        [
            status("p-idle-other", pb.ROLE_PREFILL, 2, P_OTHER),  # idle, but incompatible
            status("p-busy", pb.ROLE_PREFILL, 1, P_TP1, inflight=3),
            status("p-less-busy", pb.ROLE_PREFILL, 2, P_TP2, inflight=1),
            status("d-idle-other", pb.ROLE_DECODE, 1, Spec("x", "decode", 1, OTHER)),
            status("d-tp2", pb.ROLE_DECODE, 2, D_TP2, inflight=5),
        ]
    )
    names = {(p.engine_id, e.engine_id) for p, e in d.pairs}
    assert names == {
        ("p-busy", "d-tp2"),
        ("p-less-busy", "d-tp2"),
        ("p-idle-other", "d-idle-other"),
    }
    picks = []
    for _ in range(6):
        pair = d.pick_pair()
        assert pair is not None
        picks.append((pair[0].engine_id, pair[1].engine_id))
        pair[0].local += 1
        pair[1].local += 1
    # Loads (prefill + decode): other pair 0, less-busy 6, busy 8.
    assert picks[:3] == [("p-idle-other", "d-idle-other")] * 3
    assert set(picks) <= names
