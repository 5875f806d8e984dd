"""An engine a router is to use names its api_url, and publishes the one
failure policy that both it and the router follow.

- api_url: the connector refuses a config without one (the engine does not
  start), the coordinator refuses a routable agent's hello without one
  (INVALID_ARGUMENT naming api_url, which the engine's log shows), and a
  router says once why it does not use a listed engine (and its 503 names it).
- on_transfer_failure: set once, in the engine's kv_connector_extra_config.
  The hello publishes it, ListEngines lists it, and the router applies the
  decode engine's to that engine's requests; the router has no setting of its
  own that could disagree (its old flag is refused, naming what replaced it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator, MutableMapping
from typing import Any

import aiohttp
import grpc
import pytest
import structlog
import torch
from aiohttp import web

from pushkv.agent.nixl_adapter import quiet_nixl_env
from pushkv.cli import main as cli
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.router import engines as router_engines
from pushkv.router.app import Router, RouterSettings
from pushkv.router.engines import EngineDirectory
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.settings import ConnectorSettings
from pushkv.vllm_integration.worker import PushWorkerHalf
from tests.support.sim_agent import POLICIES, SimAgent, hello, serving
from tests.support.waits import wait_until

WAIT_S = 10.0


@pytest.fixture(scope="module")
def coord() -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess("--log-level", "WARNING").start()
    yield c
    c.stop()


async def first_answer(address: str, msg: pb.AgentMessage) -> tuple[grpc.StatusCode, str]:
    """The status an AgentStream opened with `msg` ends with, or OK once welcomed."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = pbg.AgentServiceStub(channel).AgentStream(iter([msg]))
        try:
            async with asyncio.timeout(WAIT_S):
                async for down in call:
                    if down.HasField("welcome"):
                        call.cancel()
                        return grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return await call.code(), await call.details()


# ---------------------------------------------------------------- api_url


def test_the_connector_refuses_a_routable_engine_without_api_url() -> None:
    """The engine's start fails, in its own log, naming the key to set."""
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.api_url is required"):
        ConnectorSettings.from_extra_config({"coordinator": "c:1"})
    with pytest.raises(ValueError, match="is not an http:// or https:// URL"):
        ConnectorSettings.from_extra_config({"coordinator": "c:1", "api_url": "10.0.0.7:8000"})
    served = ConnectorSettings.from_extra_config({"coordinator": "c:1", "api_url": "http://p:8"})
    assert served.routable and served.api_url == "http://p:8"
    offline = ConnectorSettings.from_extra_config({"coordinator": "c:1", "routable": "false"})
    assert not offline.routable and offline.api_url == ""


async def test_the_coordinator_refuses_a_routable_hello_without_api_url(
    coord: CoordinatorProcess,
) -> None:
    bare = serving(hello("p-bare", "prefill"), "")
    code, details = await first_answer(coord.address, bare)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("api_url: engine 'p-bare' is routable but gave no api_url")

    no_scheme = serving(hello("p-host", "prefill"), "p-host:8000")
    code, details = await first_answer(coord.address, no_scheme)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("api_url: 'p-host:8000' is not an http:// or https:// URL")

    unknown = serving(hello("p-odd", "prefill"), "http://p-odd:8000")
    unknown.hello.on_transfer_failure = 7  # type: ignore[assignment]
    code, details = await first_answer(coord.address, unknown)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("on_transfer_failure: 7 is not an OnTransferFailure value")

    # A data-plane-only agent (a KV host) may leave api_url empty.
    assert (await first_answer(coord.address, hello("kv-host", "prefill")))[0] == (
        grpc.StatusCode.OK
    )


@pytest.fixture
def nixl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in quiet_nixl_env(loopback=True).items():
        monkeypatch.setenv(key, value)


def test_a_worker_without_api_url_says_why_in_the_engines_log(
    coord: CoordinatorProcess, nixl_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Settings made in code (not from kv_connector_extra_config) reach the
    coordinator as they are: its refusal is the worker's log line."""
    caplog.set_level(logging.ERROR, logger="pushkv.agent")
    engine_id = f"D-{uuid.uuid4().hex[:8]}"
    half = PushWorkerHalf(
        ConnectorSettings(coordinator=coord.address, register_timeout_s=0.5),
        engine_id=engine_id,
        is_prefill=False,
        tp_rank=0,
        tp_size=1,
        tokens_per_block=16,
        num_blocks=8,
        compat={"model": "tiny"},
    )
    try:
        half.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(8, 2, 16, 16)})
        assert half.agent is not None

        def refused() -> bool:
            return any("rejected this agent" in r.getMessage() for r in caplog.records)

        wait_until(refused, "the coordinator's refusal in the worker's log", WAIT_S)
        assert not half.agent.registered
        (line,) = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()][:1]
        assert "INVALID_ARGUMENT" in line
        assert f"api_url: engine '{engine_id}' is routable but gave no api_url" in line
    finally:
        half.shutdown()


def listed(
    engine_id: str, role: int, *, api_url: str = "", ready: bool = True, policy: str = ""
) -> pb.EngineStatus:
    return pb.EngineStatus(
        engine_id=engine_id,
        role=role,  # type: ignore[arg-type]
        tp_size=1,
        ready=ready,
        tokens_per_block=16,
        api_url=api_url,
        on_transfer_failure=POLICIES[policy],
    )


@contextlib.contextmanager
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[MutableMapping[str, Any]]]:
    """The router directory's log lines. A logger an earlier test used in this
    process is cached with that test's configuration (the processes' own
    configure caches loggers on first use), so the directory logs through a
    fresh one while structlog captures."""
    with structlog.testing.capture_logs() as lines:
        # Every level (an earlier configure may have filtered below WARNING);
        # capture_logs restores the whole configuration on the way out.
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
        monkeypatch.setattr(router_engines, "log", structlog.get_logger("pushkv.router"))
        yield lines


def test_the_router_says_once_why_it_does_not_use_an_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = EngineDirectory(stub=None)  # type: ignore[arg-type]
    engines = [
        listed("p-0", pb.ROLE_PREFILL, api_url="http://p"),
        listed("d-host", pb.ROLE_DECODE),  # registered without api_url
        listed("d-late", pb.ROLE_DECODE, api_url="http://d", ready=False),
    ]
    with captured(monkeypatch) as lines:
        for _ in range(3):  # three refreshes, each listing the same engines
            d.update(engines)
    said = sorted((e["engine_id"], e["reason"], e["log_level"]) for e in lines)
    assert said == [("d-host", "no_api_url", "warning"), ("d-late", "not_ready", "info")]
    assert all(e["event"] == "engine_not_used" for e in lines)
    assert d.decode == {} and list(d.prefill) == ["p-0"]
    assert "d-host (no_api_url: it registered without an api_url" in d.unused_hint()
    # Usable, then unusable again: said again.
    with captured(monkeypatch) as lines:
        d.update([engines[0], listed("d-host", pb.ROLE_DECODE, api_url="http://d"), engines[2]])
        d.update(engines)
    assert [(e["engine_id"], e["reason"]) for e in lines] == [("d-host", "no_api_url")]


@pytest.fixture
async def router(coord: CoordinatorProcess) -> AsyncIterator[tuple[Router, str]]:
    r = Router(RouterSettings(coordinator=coord.address, port=0))
    runner = web.AppRunner(r.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield r, f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_a_503_names_the_engine_not_used_and_why(
    coord: CoordinatorProcess, router: tuple[Router, str]
) -> None:
    """A decode engine registered without api_url: the router's answer says so."""
    r, url = router
    agent = SimAgent(coord.address, f"d-{uuid.uuid4().hex[:6]}", "decode")
    await agent.start()
    try:
        await r.directory.refresh()
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/completions", json={"prompt": "hi"}) as resp,
        ):
            assert resp.status == 503
            message = (await resp.json())["error"]["message"]
        assert message.startswith("no engine available: no decode engine available")
        assert f"not used: {agent.engine_id} (no_api_url: " in message
    finally:
        await agent.close()


# ---------------------------------------------------------------- one failure policy


@pytest.mark.parametrize("policy", ["", "recompute", "fail"])
async def test_list_engines_publishes_the_engines_policy_and_the_router_follows_it(
    coord: CoordinatorProcess, policy: str
) -> None:
    engine_id = f"d-{policy or 'unstated'}-{uuid.uuid4().hex[:6]}"
    agent = SimAgent(coord.address, engine_id, "decode")
    serving(agent.hello, "http://d:8000", policy)
    await agent.start()
    try:
        async with grpc.aio.insecure_channel(coord.address) as channel:
            stub = pbg.StatusServiceStub(channel)
            resp = await stub.ListEngines(pb.ListEnginesRequest(), timeout=WAIT_S)
            (mine,) = [e for e in resp.engines if e.engine_id == engine_id]
            assert mine.on_transfer_failure == POLICIES[policy]
            d = EngineDirectory(stub)
            await d.refresh()
        # Unstated reads as recompute, the connector's default.
        assert d.decode[engine_id].recompute is (policy != "fail")
    finally:
        await agent.close()


def test_the_routers_own_policy_setting_is_refused_naming_its_replacement(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["router", "--on-transfer-failure", "fail"])
    assert stopped.value.code == 2
    assert "--on-transfer-failure is gone: the router follows each decode engine's" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("PUSHKV_ON_TRANSFER_FAILURE", "fail")
    assert cli.main(["router", "--port", "0"]) == 2
    assert "PUSHKV_ON_TRANSFER_FAILURE is no longer read" in capsys.readouterr().err
