"""The pushkv router, in process, against a real coordinator and stand-in engines.

The router finds its engines through the coordinator (ListEngines), so each
test registers one prefill and one decode engine there with ``SimAgent``s
(real agent streams) whose hello carries an ``api_url``.  Behind those URLs
run small aiohttp servers written here: they stand in for the HTTP surface
of a vLLM OpenAI server ONLY (record each leg, answer or stream as the test
says, notice a closed connection).  No model runs and no KV moves; running
real vLLM servers is the end-to-end test's job.  Ordering is asserted with
events and deadlines, never with sleeps.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import grpc
import pytest
from aiohttp import web

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.router.app import Router, RouterSettings
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimAgent, serving

# These stand-in engines answer the concurrent-dispatch flow (both legs at once,
# the first token from the decode engine); tests/test_router_first_token.py
# covers the default, the first token from the prefill.
_DECODE_FIRST: dict[str, Any] = {"first_token": "decode"}

DEADLINE_S = 10.0
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

Respond = Callable[["FakeEngine", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


# ---------------------------------------------------------------- stand-in engines


@dataclass
class Leg:
    path: str
    body: dict[str, Any]
    request_id: str


class FakeEngine:
    """The HTTP surface of one engine: records legs and answers with `respond`."""

    def __init__(self, name: str, respond: Respond) -> None:
        self.name = name
        self.respond = respond
        self.legs: list[Leg] = []
        self.arrived = asyncio.Event()  # a leg reached this engine
        self.answered = asyncio.Event()  # a handler returned its response
        self.closed = asyncio.Event()  # a handler was cut off (its connection closed)
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post(COMPLETIONS, self._handle)
        app.router.add_post(CHAT, self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.legs.append(Leg(request.path, body, request.headers.get("X-Request-Id", "")))
        self.arrived.set()
        try:
            resp = await self.respond(self, request, body)
        except asyncio.CancelledError:
            self.closed.set()
            raise
        self.answered.set()
        return resp


def completion(text: str, chat: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": "cmpl-x", "object": "text_completion", "choices": [choice]}


def sse(i: int) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': f'tok{i}'}]})}\n\n".encode()


async def answer_json(
    engine: FakeEngine, request: web.Request, body: dict[str, Any]
) -> web.Response:
    return web.json_response(completion(f"{engine.name} says hi", request.path == CHAT))


async def wait(event: asyncio.Event, what: str) -> None:
    try:
        async with asyncio.timeout(DEADLINE_S):
            await event.wait()
    except TimeoutError:
        raise AssertionError(f"{what} did not happen within {DEADLINE_S} s") from None


# ---------------------------------------------------------------- cluster


@pytest.fixture
def coord() -> Iterator[CoordinatorProcess]:
    # One per test: engines of earlier tests must not linger in ListEngines.
    c = CoordinatorProcess("--log-level", "WARNING").start()
    yield c
    c.stop()


@dataclass
class Cluster:
    router: Router
    url: str
    prefill: FakeEngine | None
    decode: FakeEngine | None
    status: pbg.StatusServiceAsyncStub
    http: aiohttp.ClientSession
    agents: list[SimAgent] = field(default_factory=list)

    async def wait_transfer(self, transfer_id: str, state: int) -> pb.TransferStatus:
        """Watch the coordinator until the transfer reaches `state` (with a deadline)."""
        last: pb.TransferStatus | None = None
        call = self.status.WatchTransfers(
            pb.WatchTransfersRequest(include_existing=True), timeout=DEADLINE_S
        )
        try:
            async for ev in call:
                if ev.transfer.transfer_id == transfer_id:
                    last = ev.transfer
                    if last.state == state:
                        return last
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        finally:
            call.cancel()
        raise AssertionError(f"{transfer_id} not in state {state} in time; last: {last}")


@asynccontextmanager
async def cluster(
    coord: CoordinatorProcess,
    prefill: Respond | None = answer_json,
    decode: Respond | None = answer_json,
    on_transfer_failure: str = "",
    **settings: Any,
) -> AsyncIterator[Cluster]:
    """Stand-in engines registered at the coordinator, each publishing
    `on_transfer_failure` as a connector does, then the router in process."""
    engines: list[FakeEngine] = []
    agents: list[SimAgent] = []
    channel = grpc.aio.insecure_channel(coord.address)
    runner: web.AppRunner | None = None
    try:
        fakes: dict[str, FakeEngine | None] = {}
        for role, respond in (("prefill", prefill), ("decode", decode)):
            if respond is None:
                fakes[role] = None
                continue
            eng = await FakeEngine(role, respond).start()
            engines.append(eng)
            fakes[role] = eng
            agent = SimAgent(coord.address, f"{role}-0", role, heartbeat_interval=0.5)
            serving(agent.hello, eng.url, on_transfer_failure)
            await agent.start()
            agents.append(agent)
        router = Router(
            RouterSettings(coordinator=coord.address, port=0, **{**_DECODE_FIRST, **settings})
        )
        runner = web.AppRunner(router.app(), handler_cancellation=True)  # as `serve` does
        await runner.setup()  # runs Router.start: the first ListEngines
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as http:
            yield Cluster(
                router,
                f"http://{host}:{port}",
                fakes["prefill"],
                fakes["decode"],
                pbg.StatusServiceStub(channel),
                http,
                agents,
            )
    finally:
        if runner is not None:
            await runner.cleanup()
        for eng in engines:
            await eng.stop()
        for agent in agents:
            await agent.close()
        await channel.close(None)


# ---------------------------------------------------------------- dispatch


@pytest.mark.parametrize(
    ("path", "stream"),
    [(COMPLETIONS, False), (CHAT, False), (COMPLETIONS, True), (CHAT, True)],
    ids=["completions", "chat", "completions-stream", "chat-stream"],
)
async def test_legs_are_dispatched_concurrently_with_the_contract(
    coord: CoordinatorProcess, path: str, stream: bool
) -> None:
    order: list[str] = []
    legs: dict[str, FakeEngine] = {}

    async def prefill(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        order.append("prefill arrived")
        # Hold the prefill leg until the decode leg reached its engine: a router
        # that waited for prefill before dispatching decode would stall here.
        await wait(legs["decode"].arrived, "decode leg arrival while prefill runs")
        order.append("prefill answered")
        return web.json_response(completion("p", path == CHAT))

    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        order.append("decode arrived")
        await wait(legs["prefill"].arrived, "prefill leg arrival")
        if not body.get("stream"):
            return web.json_response(completion("decoded", path == CHAT))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(sse(i))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with cluster(coord, prefill, decode) as c:
        assert c.prefill is not None and c.decode is not None
        legs.update(prefill=c.prefill, decode=c.decode)
        client_body: dict[str, Any] = {"model": "tiny", "max_tokens": 5, "temperature": 0.0}
        if path == CHAT:
            client_body["messages"] = [{"role": "user", "content": "hello"}]
        else:
            client_body["prompt"] = "hello there"
        if stream:
            client_body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with c.http.post(c.url + path, json=client_body) as resp:
            assert resp.status == 200
            raw = await resp.read()
        if stream:
            assert resp.content_type == "text/event-stream"
            assert raw == b"".join(sse(i) for i in range(3)) + b"data: [DONE]\n\n"
        else:
            assert json.loads(raw) == completion("decoded", path == CHAT)
        await wait(c.prefill.answered, "prefill answer")
        assert order.index("decode arrived") < order.index("prefill answered")

        (p_leg,) = c.prefill.legs
        (d_leg,) = c.decode.legs
        tid = p_leg.body["kv_transfer_params"]["transfer_id"]
        assert isinstance(tid, str) and tid.startswith("tx-")
        assert p_leg.path == d_leg.path == path
        assert p_leg.request_id == d_leg.request_id == tid
        # Prefill: one token, no stream, pushes its KV for this transfer.
        expected_prefill = {
            k: v for k, v in client_body.items() if k not in ("stream", "stream_options")
        }
        expected_prefill |= {
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
        }
        if path == CHAT:
            expected_prefill["max_completion_tokens"] = 1
        assert p_leg.body == expected_prefill
        # Decode: the client's request as is (stream flag included) + the same id.
        assert d_leg.body == client_body | {
            "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": tid}
        }
        # The router announced the pairing; nothing failed, so nothing was cancelled
        # (no KV moves here: the stand-in engines report nothing).
        t = await c.status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)
        assert t.state == pb.TRANSFER_STATE_AWAITING
        assert (t.prefill_engine_id, t.decode_engine_id) == ("prefill-0", "decode-0")
        # GET /timings: when the decode engine's first streamed bytes reached the
        # router, by transfer id (stamped before they were relayed to the client).
        async with c.http.get(c.url + "/timings") as r:
            timings = await r.json()
        if stream:
            assert isinstance(timings[tid]["decode_first_byte"], float)
        else:
            assert "decode_first_byte" not in timings.get(tid, {})


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_stream_chunks_pass_through_as_they_come(
    coord: CoordinatorProcess, path: str
) -> None:
    client_has_first = asyncio.Event()

    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(0))
        # The rest only after the client saw the first chunk: a buffering
        # router would never deliver it.
        await wait(client_has_first, "the client reading the first chunk")
        await resp.write(sse(1))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with cluster(coord, decode=decode) as c:
        body: dict[str, Any] = {"model": "tiny", "stream": True}
        body |= (
            {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
        )
        async with c.http.post(c.url + path, json=body) as resp:
            assert resp.status == 200
            async with asyncio.timeout(DEADLINE_S):
                first = await resp.content.readuntil(b"\n\n")
            assert first == sse(0)
            client_has_first.set()
            async with asyncio.timeout(DEADLINE_S):
                rest = await resp.read()
        assert rest == sse(1) + b"data: [DONE]\n\n"
        assert len(c.router.ttft_s) == 1


async def test_client_disconnect_mid_stream_cancels_the_transfer(
    coord: CoordinatorProcess,
) -> None:
    forever = asyncio.Event()  # never set

    async def prefill(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        await forever.wait()
        raise AssertionError("unreachable")

    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(0))
        await forever.wait()  # until the router closes this connection
        return resp

    async with cluster(coord, prefill, decode) as c:
        assert c.prefill is not None and c.decode is not None
        body = {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 50}
        resp = await c.http.post(c.url + COMPLETIONS, json=body)
        async with asyncio.timeout(DEADLINE_S):
            assert await resp.content.readuntil(b"\n\n") == sse(0)
        await wait(c.prefill.arrived, "prefill leg arrival")
        resp.close()  # the client goes away mid-stream

        tid = c.decode.legs[0].body["kv_transfer_params"]["transfer_id"]
        t = await c.wait_transfer(tid, pb.TRANSFER_STATE_CANCELLED)
        assert t.reason == pb.REASON_CANCELLED
        assert "client disconnected" in t.detail
        # Both legs' connections are closed: the engines abort their requests.
        await wait(c.decode.closed, "decode connection closed")
        await wait(c.prefill.closed, "prefill connection closed")
        assert not c.decode.answered.is_set() and not c.prefill.answered.is_set()


# ---------------------------------------------------------------- failures


class Routed(Protocol):
    """A test cluster with a router (Cluster here, Mixed in test_router_pairing.py)."""

    router: Router


def sample(c: Routed, name: str, **labels: str) -> float | None:
    return c.router.metrics.registry.get_sample_value(name, labels)


def decode_after_transfer_ends(status: list[pbg.StatusServiceAsyncStub], answer: int) -> Respond:
    """A decode engine that answers only once its transfer has ended (cancelled):
    200 as a recomputing engine would, or `answer` as a failing one would."""

    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        tid = body["kv_transfer_params"]["transfer_id"]
        call = status[0].WatchTransfers(
            pb.WatchTransfersRequest(include_existing=True), timeout=DEADLINE_S
        )
        async for ev in call:
            if ev.transfer.transfer_id == tid and ev.transfer.state == pb.TRANSFER_STATE_CANCELLED:
                call.cancel()
                break
        if answer == 200:
            return await answer_json(engine, request, body)
        return web.json_response({"error": {"message": "KV transfer failed"}}, status=answer)

    return decode


async def prefill_500(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
    return web.json_response({"error": {"message": "boom"}}, status=500)


async def test_a_failed_prefill_leg_falls_back_to_the_decode_engine(
    coord: CoordinatorProcess,
) -> None:
    """Default (recompute): the transfer is cancelled, so the decode engine learns no
    KV is coming and computes it itself; the router keeps relaying the decode leg."""
    status: list[pbg.StatusServiceAsyncStub] = []
    async with cluster(coord, prefill_500, decode_after_transfer_ends(status, 200)) as c:
        assert c.prefill is not None
        status.append(c.status)
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 200
            assert (await resp.json()) == completion("decode says hi")
        tid = c.prefill.legs[0].body["kv_transfer_params"]["transfer_id"]
        t = await c.wait_transfer(tid, pb.TRANSFER_STATE_CANCELLED)
        assert "prefill leg failed" in t.detail and "500" in t.detail
        assert sample(c, "pushkv_router_fallbacks_total", reason="prefill_failed") == 1


async def test_a_failed_prefill_leg_fails_fast_when_configured(coord: CoordinatorProcess) -> None:
    """The decode engine's on_transfer_failure is fail: a 502 naming the stage at
    once, without waiting for the decode leg (which is cut off, and its transfer
    cancelled)."""
    status: list[pbg.StatusServiceAsyncStub] = []
    hold = asyncio.Event()

    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        await hold.wait()  # never answers on its own: the router must not wait for it
        return await answer_json(engine, request, body)

    async with cluster(coord, prefill_500, decode, on_transfer_failure="fail") as c:
        assert c.prefill is not None and c.decode is not None
        status.append(c.status)
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 502
            assert "Retry-After" not in resp.headers  # the engine answered: no retry helps
            err = (await resp.json())["error"]
        assert err["stage"] == "prefill_failed" and err["type"] == "bad_gateway"
        assert err["message"].startswith("prefill engine failed: HTTP 500")
        await wait(c.decode.closed, "decode leg cut off")
        tid = c.prefill.legs[0].body["kv_transfer_params"]["transfer_id"]
        t = await c.wait_transfer(tid, pb.TRANSFER_STATE_CANCELLED)
        assert "prefill leg failed" in t.detail and t.detail.endswith("(request failed)")
        assert sample(c, "pushkv_router_fallbacks_total", reason="prefill_failed") == 0


async def test_a_decode_engine_error_is_a_502_naming_the_stage(coord: CoordinatorProcess) -> None:
    status: list[pbg.StatusServiceAsyncStub] = []
    async with cluster(coord, prefill_500, decode_after_transfer_ends(status, 500)) as c:
        status.append(c.status)
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 502
            err = (await resp.json())["error"]
        assert err["stage"] == "decode_failed"
        assert err["message"] == "decode engine failed: decode-0: HTTP 500: KV transfer failed"


async def test_a_lost_decode_engine_is_a_502_with_retry_after(coord: CoordinatorProcess) -> None:
    async with cluster(coord) as c:
        assert c.decode is not None and c.prefill is not None
        await c.decode.stop()  # still listed: its lease has not lapsed
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 502
            assert resp.headers["Retry-After"] == "1"
            err = (await resp.json())["error"]
        assert err["stage"] == "decode_lost" and "decode-0" in err["message"]
        # The transfer is cancelled (the prefill leg may never have left).
        listed = await c.status.ListTransfers(pb.ListTransfersRequest(), timeout=5)
        (t,) = listed.transfers
        await c.wait_transfer(t.transfer_id, pb.TRANSFER_STATE_CANCELLED)


async def test_a_decode_leg_past_its_time_limit_is_a_504(coord: CoordinatorProcess) -> None:
    hold = asyncio.Event()

    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        await hold.wait()  # never answers
        return await answer_json(engine, request, body)

    async with cluster(coord, decode=decode, leg_timeout_s=1.0) as c:
        assert c.decode is not None
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 504
            err = (await resp.json())["error"]
        assert err["stage"] == "timeout" and err["type"] == "gateway_timeout"
        assert err["message"] == "timed out: decode leg after 1 s"
        await wait(c.decode.closed, "decode leg cut off")
        tid = c.decode.legs[0].body["kv_transfer_params"]["transfer_id"]
        await c.wait_transfer(tid, pb.TRANSFER_STATE_CANCELLED)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_an_unreachable_coordinator(coord: CoordinatorProcess, policy: str) -> None:
    """recompute: the decode engine serves the request alone (no kv_transfer_params,
    no prefill leg); fail: a 503 naming the coordinator, with Retry-After."""
    async with cluster(coord, on_transfer_failure=policy) as c:
        assert c.prefill is not None and c.decode is not None
        coord.stop()  # the router keeps the engines it last listed
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 3}) as r:
            status, answer = r.status, await r.json()
            retry_after = r.headers.get("Retry-After")
        reason = "coordinator_unavailable"
        if policy == "fail":
            assert status == 503 and retry_after == "1"
            assert answer["error"]["stage"] == reason
            assert c.decode.legs == []
            assert sample(c, "pushkv_router_fallbacks_total", reason=reason) == 0
        else:
            assert status == 200 and answer == completion("decode says hi")
            (leg,) = c.decode.legs
            assert leg.body == {"prompt": "hi", "max_tokens": 3}
            assert sample(c, "pushkv_router_fallbacks_total", reason=reason) == 1
        assert c.prefill.legs == []


@pytest.mark.parametrize("grace", [10.0, 0.0], ids=["within-grace", "past-grace"])
async def test_a_restarted_coordinator_lists_no_engine_yet(
    coord: CoordinatorProcess, grace: float
) -> None:
    """A restarted coordinator lists no engine until the agents reconnect (these
    SimAgents never do). Within --unlisted-grace-s the router still sends new
    requests to the decode engine it listed last, alone, instead of a 503;
    past it (grace 0) the 503 names the missing decode engine."""
    async with cluster(coord, unlisted_grace_s=grace) as c:
        assert c.prefill is not None and c.decode is not None
        d = c.router.directory
        assert d.decode
        coord.stop()
        coord.start()  # the same address, no engine registered
        async with asyncio.timeout(DEADLINE_S):
            # The router's refresh reached the new coordinator (its view, polled).
            while d.decode or d.error:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 3}) as r:
            status, answer = r.status, await r.json()
        if grace:
            assert status == 200 and answer == completion("decode says hi")
            (leg,) = c.decode.legs
            assert leg.body == {"prompt": "hi", "max_tokens": 3}  # alone: no transfer
            assert sample(c, "pushkv_router_fallbacks_total", reason="decode_unlisted") == 1
        else:
            assert status == 503 and answer["error"]["stage"] == "no_engine", answer
            assert "no decode engine available" in answer["error"]["message"]
            assert c.decode.legs == []
        assert c.prefill.legs == []


async def test_a_leg_on_a_connection_the_engine_closed_is_sent_again(
    coord: CoordinatorProcess,
) -> None:
    """An engine closing an idle keep-alive connection just as the router sends a
    leg on it (vLLM's uvicorn does after 5 s idle) must not fail the request.

    The stand-in engines close each reused connection once, on the request that
    reused it, without answering: what the router sees in that race."""
    dropped: dict[str, int] = {"prefill": 0, "decode": 0}
    answered_on: dict[str, set[Any]] = {"prefill": set(), "decode": set()}

    def dropping(role: str) -> Respond:
        async def respond(
            engine: FakeEngine, request: web.Request, body: dict[str, Any]
        ) -> web.StreamResponse:
            transport = request.transport
            assert transport is not None
            conn = transport.get_extra_info("peername")
            if conn in answered_on[role] and not dropped[role]:
                dropped[role] += 1
                transport.close()
                raise asyncio.CancelledError  # the engine never answers this one
            answered_on[role].add(conn)
            return await answer_json(engine, request, body)

        return respond

    async with cluster(coord, dropping("prefill"), dropping("decode")) as c:
        assert c.prefill is not None
        for _ in range(3):
            async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json()) == completion("decode says hi")
            await wait(c.prefill.answered, "prefill answer")
            c.prefill.answered.clear()
        assert dropped == {"prefill": 1, "decode": 1}
        sample = c.router.metrics.registry.get_sample_value
        for leg in ("prefill", "decode"):
            assert sample("pushkv_router_leg_retries_total", {"leg": leg}) == 1
        # Every transfer still awaits its (stand-in) KV: none was cancelled.
        for sent in c.prefill.legs:
            tid = sent.body["kv_transfer_params"]["transfer_id"]
            t = await c.status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)
            assert t.state == pb.TRANSFER_STATE_AWAITING


async def test_decode_leg_client_error_passes_through_and_cancels_the_transfer(
    coord: CoordinatorProcess,
) -> None:
    """E.g. vLLM rejects the decode leg (400): the prefill side must not hold its KV."""

    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        return web.json_response({"error": {"message": "prompt too long"}}, status=400)

    async with cluster(coord, decode=decode) as c:
        assert c.decode is not None
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["message"] == "prompt too long"
        tid = c.decode.legs[0].body["kv_transfer_params"]["transfer_id"]
        t = await c.wait_transfer(tid, pb.TRANSFER_STATE_CANCELLED)
        assert "decode failed" in t.detail


async def test_no_engines_is_503(coord: CoordinatorProcess) -> None:
    async with cluster(coord, prefill=None, decode=None) as c:
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 503
            err = (await resp.json())["error"]
        assert err["code"] == 503 and err["type"] == "service_unavailable"
        assert err["stage"] == "no_engine" and "no decode engine available" in err["message"]
        async with c.http.get(c.url + "/health") as resp:
            assert resp.status == 503


async def test_no_prefill_engine_falls_back_or_is_503(coord: CoordinatorProcess) -> None:
    async with cluster(coord, prefill=None) as c:
        assert c.decode is not None
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 200
        assert "kv_transfer_params" not in c.decode.legs[0].body
        assert sample(c, "pushkv_router_fallbacks_total", reason="no_prefill_engine") == 1
    async with (
        cluster(coord, prefill=None, on_transfer_failure="fail") as c,
        c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp,
    ):
        assert resp.status == 503
        assert "no prefill engine available" in (await resp.json())["error"]["message"]


async def test_no_decode_engine_is_503(coord: CoordinatorProcess) -> None:
    async with cluster(coord, decode=None) as c:
        assert c.prefill is not None
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 503
            assert "no decode engine available" in (await resp.json())["error"]["message"]
        assert c.prefill.legs == []


BAD_REQUESTS: list[tuple[str, str, bytes, int, str]] = [
    ("invalid-json", COMPLETIONS, b"{not json", 400, "not valid JSON"),
    ("empty", COMPLETIONS, b"", 400, "not valid JSON"),
    ("non-object", COMPLETIONS, b"[1, 2]", 400, "must be a JSON object"),
    ("no-prompt", COMPLETIONS, b'{"model": "tiny"}', 400, "'prompt'"),
    ("empty-prompt", COMPLETIONS, b'{"prompt": ""}', 400, "'prompt'"),
    ("no-messages", CHAT, b'{"prompt": "hi"}', 400, "'messages'"),
    ("empty-messages", CHAT, b'{"messages": []}', 400, "'messages'"),
    (
        "client-kv-params",
        COMPLETIONS,
        b'{"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": true}}',
        400,
        "kv_transfer_params",
    ),
    ("max-tokens-0", COMPLETIONS, b'{"prompt": "hi", "max_tokens": 0}', 400, "'max_tokens'"),
    ("max-tokens-bool", COMPLETIONS, b'{"prompt": "hi", "max_tokens": true}', 400, "'max_tokens'"),
    (
        "max-completion-tokens-negative",
        CHAT,
        b'{"messages": [{"role": "user"}], "max_completion_tokens": -1}',
        400,
        "'max_completion_tokens'",
    ),
    ("too-large", COMPLETIONS, b'{"prompt": "' + b"x" * 4096 + b'"}', 413, "larger than 1024"),
]


async def test_bad_requests_are_refused_before_dispatch(coord: CoordinatorProcess) -> None:
    async with cluster(coord, max_body_bytes=1024) as c:
        assert c.prefill is not None and c.decode is not None
        headers = {"Content-Type": "application/json"}
        for name, path, data, status, message in BAD_REQUESTS:
            async with c.http.post(c.url + path, data=data, headers=headers) as resp:
                assert resp.status == status, name
                err = (await resp.json())["error"]
            assert err["code"] == status and err["type"] == "invalid_request_error", name
            assert message in err["message"], (name, err)
        # A valid request still goes through on the same router.
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi"}) as resp:
            assert resp.status == 200
        assert len(c.prefill.legs) == 1 and len(c.decode.legs) == 1
