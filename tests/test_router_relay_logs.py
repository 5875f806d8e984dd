"""`pushkv router` and `pushkv relay` log as the coordinator does
(pushkv/net/logs.py): every line of their output is one JSON object with
`event`, `level` and `timestamp`, and `transfer_id`, `engine_id` and `rank`
where a line is about one. Both run as child processes, as deployed; the
engines behind the router are stand-ins (aiohttp servers here, their agents
SimAgents), the coordinator a real one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from pushkv.harness.coordinator import CoordinatorProcess, RelayProcess
from pushkv.harness.vllm_server import RouterProcess
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimAgent, hello, serving

WAIT_S = 20.0
KEYS = {"event", "level", "timestamp"}


@pytest.fixture
def coord() -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess("--log-level", "WARNING").start()
    yield c
    c.stop()


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of `text` as JSON, each with the keys every line has."""
    out = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(obj, dict) and obj.keys() >= KEYS, line
        out.append(obj)
    return out


async def logged(text: Callable[[], str], event: str) -> list[dict[str, Any]]:
    """The lines of `event` in a child's log, once there is one (read as the
    log grows, under a deadline; the test's event loop keeps serving)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = [o for o in json_lines(text()) if o["event"] == event]
        if found:
            return found
        assert time.monotonic() < deadline, f"no {event} line within {WAIT_S} s: {text()}"
        await asyncio.sleep(0.05)  # polling another process's log under a deadline


async def held_open(first: pb.AgentMessage) -> AsyncIterator[pb.AgentMessage]:
    """An agent's side of its stream: the hello, then open until the answer."""
    yield first
    await asyncio.Event().wait()


@asynccontextmanager
async def engine(status: int) -> AsyncIterator[str]:
    """An engine's HTTP surface answering every completion with `status`; its URL."""

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"stand-in says {status}"}}, status=status)

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_every_router_line_is_json_with_the_coordinators_keys(
    coord: CoordinatorProcess,
) -> None:
    agents: list[SimAgent] = []
    router = RouterProcess(coord.address, flags=("--log-level", "INFO"))
    try:
        async with engine(500) as p_url, engine(500) as d_url:
            for name, role, url in (("p-0", "prefill", p_url), ("d-0", "decode", d_url)):
                agent = SimAgent(coord.address, name, role, heartbeat_interval=0.5)
                serving(agent.hello, url)
                agents.append(agent)
            agents.append(SimAgent(coord.address, "kv-host", "decode"))  # no api_url
            for a in agents:
                await a.start()
            router.start(timeout=WAIT_S)
            async with (
                aiohttp.ClientSession() as http,
                http.post(router.url + "/v1/completions", json={"prompt": "hi"}) as resp,
            ):
                assert resp.status == 502
            log = router.log_path.read_text
            (failed,) = await logged(log, "request_failed")
            (prefill,) = await logged(log, "prefill_leg_failed")
            (unused,) = await logged(log, "engine_not_used")
    finally:
        router.stop()
        for a in agents:
            await a.close()
    assert failed["level"] == "warning" and failed["stage"] == "decode_failed"
    assert failed["transfer_id"].startswith("tx-")
    assert prefill["transfer_id"] == failed["transfer_id"] and prefill["engine_id"] == "p-0"
    assert unused["engine_id"] == "kv-host" and unused["reason"] == "no_api_url"
    lines = json_lines(router.log_path.read_text())  # to the last line, after the stop
    assert any(o["event"] == "router_listening" for o in lines)
    # A library's line through the standard library's logging: the same shape.
    access = [o for o in lines if o.get("logger") == "aiohttp.access"]
    assert access and all(o["level"] == "info" for o in access)


async def test_every_relay_line_is_json_with_the_coordinators_keys(
    coord: CoordinatorProcess,
) -> None:
    relay = RelayProcess(coord.address, "--log-level", "INFO").start()
    try:
        agent = SimAgent(relay.address, "d-1", "decode", rank=1, tp_size=2)
        await agent.start()
        await agent.close()
        # A routable engine without api_url: refused by the coordinator, and
        # the relay's line names the agent and the refusal.
        bare = serving(hello("p-bare", "prefill"), "")
        async with grpc.aio.insecure_channel(relay.address) as channel:
            call = pbg.AgentServiceStub(channel).AgentStream(held_open(bare))
            async with asyncio.timeout(WAIT_S):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in call:
                        pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ended = await logged(relay.log_text, "agent_stream_ended")
    finally:
        relay.stop()
    lines = json_lines(relay.log_text())
    relayed = [o for o in lines if o["event"] == "agent_relayed"]
    assert {(o["engine_id"], o["rank"]) for o in relayed} == {("d-1", 1), ("p-bare", 0)}
    (refusal,) = ended
    assert refusal["engine_id"] == "p-bare" and refusal["rank"] == 0
    assert refusal["code"] == "INVALID_ARGUMENT" and refusal["detail"].startswith("api_url:")
    assert any(o["event"] == "relay_listening" for o in lines)
