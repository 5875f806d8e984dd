"""`pushkv router`: an OpenAI-compatible HTTP front that dispatches the prefill
and decode legs of each request concurrently.

The engines come from the coordinator (ListEngines); the transfer id the router
mints is the only key the two legs share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import structlog
from aiohttp import web

from pushkv.net.codes import RETRYABLE
from pushkv.net.leader import LeaderFollower
from pushkv.net.tls import ChannelCache, TLSFiles, aio_channel
from pushkv.router import seeded
from pushkv.router.engines import Engine, EngineDirectory
from pushkv.router.failures import Failure, Stage, client_error
from pushkv.router.first_token import max_tokens, reason_not_seeded, several_sequences
from pushkv.router.legs import BadRequest, error_message, prefill_lost, split_legs, why
from pushkv.router.metrics import RouterMetrics, outcome_of
from pushkv.router.timings import DECODE_FIRST_BYTE, PREFILL_RESPONSE, FrontTimings
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

log = structlog.get_logger("pushkv.router")

MAX_BODY_BYTES = 8 * 1024 * 1024
# With several coordinator replicas, one BeginTransfer attempt waits this long
# at most (within connect_timeout_s in all): a leader answers in milliseconds,
# and one that went silent (frozen, cut off) is left for the next replica.
BEGIN_ATTEMPT_S = 2.0
ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class RouterSettings:
    coordinator: str
    host: str = "127.0.0.1"
    port: int = 8000
    refresh_s: float = 1.0
    # A decode engine that drops out of the coordinator's list still serves
    # requests alone (recompute) for this long: see EngineDirectory.
    unlisted_grace_s: float = 10.0
    leg_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    # A pooled engine connection idle this long is closed by the router. It must
    # stay below the engines' own keep-alive (vLLM's uvicorn: 5 s,
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE), or the router may send a request on a
    # connection the engine is closing at that moment.
    pool_idle_s: float = 2.0
    max_body_bytes: int = MAX_BODY_BYTES
    # Where the client's first token comes from: "decode" (both legs leave at
    # once and the decode engine answers the whole request, its blocks
    # registered while the prefill computes) or "prefill" (the prefill leg's
    # sampled token, at once; the decode engine continues from token 2:
    # pushkv/router/seeded.py).
    first_token: str = "decode"
    # mTLS to the coordinator; the router's certificate CN is "router".
    tls: TLSFiles = field(default_factory=TLSFiles)


_CONNECTION_LOST = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def _mark_reused(session: Any, ctx: Any, params: Any) -> None:
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["reused"] = True


class Router:
    """What the router does when the push cannot happen is the decode engine's
    own on_transfer_failure (Engine.recompute, from ListEngines), so router and
    engine cannot disagree: "recompute" serves the request from the decode
    engine alone (a lost prefill leg, an unreachable coordinator, no prefill
    engine); "fail" answers 502/503 at once, naming the stage."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        # One coordinator address, or several replicas (comma-separated): the
        # router dials the leader (pushkv/net/leader.py, _follow_leader).
        self._follower = LeaderFollower(settings.coordinator)
        # A channel per replica, replaced when the TLS files change (renewed
        # certificates); a replaced one is closed once its calls are done.
        self._channels: ChannelCache[grpc.aio.Channel] = ChannelCache(
            lambda a: aio_channel(a, settings.tls), settings.tls, self._retire
        )
        self._retiring: set[grpc.aio.Channel] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stubs_on = self._channel()  # the channel the two stubs below call on
        self._transfers = pbg.TransferServiceStub(self._stubs_on)
        self.directory = EngineDirectory(
            pbg.StatusServiceStub(self._stubs_on), settings.unlisted_grace_s
        )
        self._http: aiohttp.ClientSession | None = None
        self.ttft_s: list[float] = []  # recent TTFTs, for tests and the demo
        self.on_dispatch: Callable[[str, str], Awaitable[None]] | None = None  # test hook
        self.metrics = RouterMetrics()
        self.timings = FrontTimings()  # GET /timings: per transfer id, for benchmarks

    # ------------------------------------------------------------ lifecycle
    async def start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=self.settings.leg_timeout_s, connect=self.settings.connect_timeout_s
        )
        connector = aiohttp.TCPConnector(keepalive_timeout=self.settings.pool_idle_s)
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_mark_reused)
        self._http = aiohttp.ClientSession(
            timeout=timeout, connector=connector, trace_configs=[trace]
        )
        if self._follower.several:
            await self._follow_leader()
            await self.directory.refresh()
            self.spawn(self._refresh_following())
        else:
            await self.directory.refresh()
            self.spawn(self._refresh_engines())

    async def stop(self, app: web.Application) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http:
            await self._http.close()
        await self.close_channels()

    async def close_channels(self) -> None:
        """Close every channel to the coordinators, cancelling their calls."""
        for channel in (*self._channels.take_all(), *self._retiring):
            await channel.close(None)
        self._retiring.clear()

    # ------------------------------------------------------------ coordinator replicas
    def _channel(self) -> grpc.aio.Channel:
        return self._channels.get(self._follower.current)

    def _retire(self, channel: grpc.aio.Channel) -> None:
        """A channel made before the TLS files changed: closed once the calls
        on it end (each has a deadline of at most this long)."""
        self._retiring.add(channel)
        grace = max(self.settings.connect_timeout_s, 5.0)

        async def close() -> None:
            await channel.close(grace)
            self._retiring.discard(channel)

        self.spawn(close())

    def _use_current(self) -> None:
        """The stubs on the channel to the replica dialed now, made from the
        TLS files as they are now (one stat of each file when unchanged)."""
        channel = self._channel()
        if channel is not self._stubs_on:
            self._stubs_on = channel
            self._transfers = pbg.TransferServiceStub(channel)
            self.directory.stub = pbg.StatusServiceStub(channel)

    async def _refresh_engines(self) -> None:
        """The engine list, every refresh_s, from the one coordinator."""
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            self._use_current()
            await self.directory.refresh()

    async def _follow_leader(self) -> None:
        """With several coordinator replicas: dial the one that leads (each
        answers GetLeadership; a standby names the leader)."""
        for attempt in range(2 * len(self._follower.addresses)):
            stub = pbg.StatusServiceStub(self._channel())
            try:
                view = await stub.GetLeadership(pb.GetLeadershipRequest(), timeout=1.0)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # a coordinator without replicas: stay
                self._follower.follow(exc)
                self._use_current()
                await asyncio.sleep(self._follower.delay(attempt))
                continue
            if view.role != pb.LEADER_ROLE_STANDBY:
                return
            if view.leader:
                self._follower.move_to(view.leader)
            else:  # no leader elected yet
                self._follower.follow()
                await asyncio.sleep(self._follower.delay(attempt))
            self._use_current()

    async def _refresh_following(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            await self._follow_leader()
            self._use_current()
            await self.directory.refresh()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/timings", self.timings.handler)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    # ------------------------------------------------------------ handlers
    async def health(self, request: web.Request) -> web.Response:
        d = self.directory
        body = {
            "prefill": sorted(d.prefill),
            "decode": sorted(d.decode),
            "pairs": [[p.engine_id, e.engine_id] for p, e in d.pairs],
            "unpaired": d.unpaired,
            "unused": d.unused,
            "error": d.error,
        }
        ok = bool(d.pairs)
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.StreamResponse:
        eng = self.directory.pick(self.directory.decode)
        if eng is None or self._http is None:
            return Failure(
                Stage.NO_ENGINE, "no decode engine" + self.directory.unused_hint()
            ).response()
        try:
            async with self._http.get(eng.url + "/v1/models") as resp:
                return web.Response(
                    body=await resp.read(), status=resp.status, content_type="application/json"
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Failure(Stage.DECODE_LOST, f"{eng.engine_id}: {exc}").response()

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": self.metrics.content_type}
        )

    async def cancel(self, transfer_id: str, reason: str) -> None:
        self._use_current()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._transfers.Cancel(
                pb.CancelRequest(transfer_id=transfer_id, reason=reason), timeout=5
            )

    async def _cancel_once_begun(
        self, begin: asyncio.Future[Any], transfer_id: str, reason: str
    ) -> None:
        """The client left while the pairing was being announced: cancel the
        transfer as soon as it exists, instead of letting it wait for the deadline."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await begin
            await self.cancel(transfer_id, reason)

    @contextlib.asynccontextmanager
    async def post(
        self, url: str, body: dict[str, Any], headers: dict[str, str], leg: str
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST one leg. Sent again, once, when the engine closed a pooled
        connection before any byte of the answer came back (an engine closing
        an idle keep-alive connection as the request goes out): only a reused
        connection is retried, so a request an engine took is never sent twice
        because of this."""
        assert self._http is not None
        for attempt in range(2):
            ctx = {"reused": False}
            try:
                resp = await self._http.post(url, json=body, headers=headers, trace_request_ctx=ctx)
            except aiohttp.ClientConnectorError:
                raise
            except _CONNECTION_LOST as exc:
                if attempt or not ctx["reused"]:
                    raise
                self.metrics.leg_retries.labels(leg).inc()
                log.info(
                    "leg_sent_again",
                    transfer_id=headers.get("X-Request-Id", ""),
                    leg=leg,
                    url=url,
                    detail=f"the engine closed a pooled connection ({why(exc)})",
                )
                continue
            async with resp:
                yield resp
            return

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one completion request, counted in pushkv_router_requests by outcome."""
        self.metrics.inflight.inc()
        outcome = "engine_error"
        try:
            try:
                response = await self._handle(request)
            except Failure as failure:
                log.warning("request_failed", path=request.path, **failure.log_fields())
                response = failure.response()
            outcome = outcome_of(response.status)
            return response
        except asyncio.CancelledError:
            outcome = "aborted"
            raise
        finally:
            self.metrics.inflight.dec()
            self.metrics.requests.labels(outcome).inc()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return client_error(413, f"body larger than {self.settings.max_body_bytes} bytes")
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            return client_error(400, "body is not valid JSON")
        if not isinstance(body, dict):
            return client_error(400, "body must be a JSON object")
        transfer_id = f"tx-{uuid.uuid4().hex}"
        try:
            prefill_body, decode_body = split_legs(body, transfer_id, chat)
        except BadRequest as exc:
            return client_error(400, str(exc))
        d = self.directory
        if several_sequences(body):
            # n > 1, best_of, beam search: vLLM runs several sequences under
            # one request id, each of which would report the one transfer.
            d_eng = d.pick(d.decode) or d.pick_unlisted()
            if d_eng is None:
                raise Failure(Stage.NO_ENGINE, "no decode engine available" + d.unused_hint())
            d_eng.local += 1
            try:
                return await self.decode_alone(request, body, d_eng, "several_sequences")
            finally:
                d_eng.local -= 1
        pair = d.pick_pair()
        if pair is None:
            return await self._unpaired(request, body)
        p_eng, d_eng = pair
        first_from_prefill = self.settings.first_token == "prefill" and not reason_not_seeded(
            body, chat
        )
        if first_from_prefill and max_tokens(body, chat) == 1:
            p_eng.local += 1
            try:
                return await seeded.prefill_alone(self, request, body, chat, p_eng)
            finally:
                p_eng.local -= 1
        # Counted at once, before any await: requests arriving together spread.
        p_eng.local += 1
        d_eng.local += 1
        p_held = True
        try:
            try:
                await self._begin(transfer_id, p_eng, d_eng)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise Failure(Stage.OVERLOADED, str(exc.details())) from None
                if not d_eng.recompute:
                    raise Failure(
                        Stage.COORDINATOR_UNAVAILABLE,
                        f"{exc.code().name} (decode engine {d_eng.engine_id}: "
                        "on_transfer_failure fail)",
                        transfer_id=transfer_id,
                    ) from None
                p_eng.local, p_held = p_eng.local - 1, False
                return await self.decode_alone(request, body, d_eng, "coordinator_unavailable")
            if first_from_prefill:
                return await seeded.seeded(self, request, transfer_id, p_eng, d_eng, body, chat)
            return await self._disaggregated(
                request, transfer_id, p_eng, d_eng, prefill_body, decode_body
            )
        finally:
            p_eng.local -= int(p_held)
            d_eng.local -= 1

    async def _unpaired(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """No (prefill, decode) pair the coordinator would accept: the decode
        engine alone serves the request (recompute), or a 503 says why (fail).
        Recompute serves it because an unpairable prefill engine leaves the
        decode engine as able to serve as no prefill engine does: the same
        fallback, counted under its own reason."""
        d = self.directory
        hint = (f" ({d.error})" if d.error else "") + d.unused_hint()
        d_eng = d.pick(d.decode)
        if d_eng is None:
            d_eng = d.pick_unlisted()
            if d_eng is None or not d_eng.recompute:
                raise Failure(Stage.NO_ENGINE, "no decode engine available" + hint)
            # e.g. a restarted coordinator whose agents are reconnecting
            reason, detail = "decode_unlisted", "no decode engine listed"
        elif not d.prefill:
            reason, detail = "no_prefill_engine", "no prefill engine available" + hint
        else:
            reason = "no_compatible_prefill"
            detail = f"no prefill engine can push into a decode engine: {d.unpaired}"
        if not d_eng.recompute:
            raise Failure(
                Stage.NO_ENGINE,
                f"{detail} (decode engine {d_eng.engine_id}: on_transfer_failure fail)",
            )
        d_eng.local += 1
        try:
            return await self.decode_alone(request, body, d_eng, reason)
        finally:
            d_eng.local -= 1

    async def _begin(self, transfer_id: str, p_eng: Engine, d_eng: Engine) -> None:
        """Announce the pairing first: the transfer is visible (and cancellable)
        before either leg arrives, and the coordinator can push back."""
        if not self._follower.several:
            return await self._begin_once(transfer_id, p_eng, d_eng)
        deadline = time.monotonic() + self.settings.connect_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return await self._begin_once(
                    transfer_id, p_eng, d_eng, max(0.05, min(left, BEGIN_ATTEMPT_S))
                )
            except grpc.aio.AioRpcError as exc:
                # BeginTransfer is idempotent (the same id with the same
                # engines answers the same), so a retry is safe after either:
                # UNAVAILABLE, a standby's refusal (nothing recorded) or a
                # replica gone; DEADLINE_EXCEEDED, a replica that went silent
                # (frozen, cut off) with its connection open.
                if exc.code() not in RETRYABLE or time.monotonic() > deadline:
                    raise
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._follower.follow(exc)
                    self._use_current()
                    await asyncio.sleep(self._follower.delay(0))
                # GetLeadership moves off a replica that does not answer.
                await self._follow_leader()

    async def _begin_once(
        self, transfer_id: str, p_eng: Engine, d_eng: Engine, timeout_s: float | None = None
    ) -> None:
        self._use_current()
        begin = asyncio.ensure_future(
            self._transfers.BeginTransfer(
                pb.BeginTransferRequest(
                    transfer_id=transfer_id,
                    prefill_engine_id=p_eng.engine_id,
                    decode_engine_id=d_eng.engine_id,
                ),
                timeout=timeout_s or self.settings.connect_timeout_s,
            )
        )
        try:
            await asyncio.shield(begin)
        except asyncio.CancelledError:
            self.spawn(self._cancel_once_begun(begin, transfer_id, "client disconnected"))
            raise

    async def decode_alone(
        self,
        request: web.Request,
        body: dict[str, Any],
        d_eng: Engine,
        reason: str,
        transfer_id: str = "",
    ) -> web.StreamResponse:
        """Fallback: the decode engine serves the request as a single engine
        would (`transfer_id`: the cancelled transfer it replaces, for the logs)."""
        self.metrics.fallbacks.labels(reason).inc()
        log.info(
            "served_by_decode_alone",
            engine_id=d_eng.engine_id,
            reason=reason,
            transfer_id=transfer_id,
        )
        headers = {"X-Request-Id": transfer_id} if transfer_id else {}
        response, _ = await self.relay(request, d_eng, body, headers, time.monotonic())
        return response

    async def _disaggregated(
        self,
        request: web.Request,
        transfer_id: str,
        p_eng: Engine,
        d_eng: Engine,
        prefill_body: dict[str, Any],
        decode_body: dict[str, Any],
    ) -> web.StreamResponse:
        started = time.monotonic()
        headers = {"X-Request-Id": transfer_id}
        decode: asyncio.Task[tuple[web.StreamResponse, bool]] | None = None

        async def prefill_leg() -> None:
            try:
                async with self.post(
                    p_eng.url + request.path, prefill_body, headers, "prefill"
                ) as resp:
                    text = await resp.text()
                    self.timings.mark(transfer_id, PREFILL_RESPONSE)
                    if resp.status != 200:
                        raise Failure(Stage.PREFILL_FAILED, f"HTTP {resp.status}: {text[:200]}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failure, reason = prefill_lost(
                    exc, p_eng.engine_id, transfer_id, self.settings.leg_timeout_s, d_eng.recompute
                )
                # The decode side learns from the coordinator that no KV is coming:
                # it recomputes (fallback) or fails the request, and no WRITE can
                # land in its blocks after that.
                # Fail fast: cut the decode leg before anything else can await,
                # so a decode engine that recomputes cannot answer in between.
                if d_eng.recompute:
                    self.metrics.fallbacks.labels("prefill_failed").inc()
                elif decode is not None and not answering.is_set():
                    lost_prefill.append(failure)
                    decode.cancel()
                await self.cancel(transfer_id, reason)

        lost_prefill: list[Failure] = []
        answering = asyncio.Event()  # the decode leg's answer has begun
        # Both legs leave now: the decode side registers its blocks while prefill runs.
        p_task = self.spawn(prefill_leg())
        finished = False
        try:
            if self.on_dispatch is not None:
                await self.on_dispatch(transfer_id, "dispatched")
            decode = asyncio.ensure_future(
                self.relay(request, d_eng, decode_body, headers, started, answering)
            )
            try:
                response, finished = await decode
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if lost_prefill and me is not None and not me.cancelling():
                    raise lost_prefill[0] from None  # fail fast: the prefill leg is lost
                raise
            return response
        finally:
            if decode is not None and not decode.done():
                decode.cancel()
            if not finished and not lost_prefill:
                # Client gone or decode failed: stop the prefill leg and release the KV.
                # (After a lost prefill leg, that leg cancels the transfer itself.)
                p_task.cancel()
                self.spawn(self.cancel(transfer_id, "client disconnected or decode failed"))
            if len(self.ttft_s) > 10_000:
                del self.ttft_s[:5_000]

    async def relay(
        self,
        request: web.Request,
        d_eng: Engine,
        body: dict[str, Any],
        headers: dict[str, str],
        started: float,
        answering: asyncio.Event | None = None,
    ) -> tuple[web.StreamResponse, bool]:
        """Send the decode leg and relay its answer to the client; (response, ok)."""
        response: web.StreamResponse | None = None
        try:
            async with self.post(d_eng.url + request.path, body, headers, "decode") as resp:
                if resp.status >= 500:
                    text = await resp.text()
                    raise Failure(
                        Stage.DECODE_FAILED,
                        f"{d_eng.engine_id}: HTTP {resp.status}: {error_message(text)}",
                        transfer_id=headers.get("X-Request-Id", ""),
                    )
                if answering is not None:
                    answering.set()
                if not body.get("stream"):
                    data = await resp.read()
                    self.observe_ttft(started)
                    # A decode error (e.g. a 400 from validation) never takes the
                    # KV: not ok, so the transfer is cancelled.
                    out = web.Response(
                        body=data, status=resp.status, content_type=resp.content_type
                    )
                    return out, resp.status == 200
                response = web.StreamResponse(status=resp.status)
                response.content_type = resp.content_type or "text/event-stream"
                response.headers["Cache-Control"] = "no-cache"
                await response.prepare(request)
                first = True
                async for chunk in resp.content.iter_any():
                    if first:
                        self.timings.mark(headers.get("X-Request-Id", ""), DECODE_FIRST_BYTE)
                        self.observe_ttft(started)
                        first = False
                    await response.write(chunk)
                await response.write_eof()
                return response, resp.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            if response is not None:
                # The answer has begun: its status is sent, so the stream breaks.
                log.warning(
                    "decode_stream_broke",
                    transfer_id=headers.get("X-Request-Id", ""),
                    engine_id=d_eng.engine_id,
                    detail=why(exc),
                )
                raise ConnectionResetError(f"decode engine {d_eng.engine_id}: {why(exc)}") from None
            if isinstance(exc, TimeoutError):
                raise Failure(
                    Stage.TIMEOUT,
                    f"decode leg after {self.settings.leg_timeout_s:g} s",
                    transfer_id=headers.get("X-Request-Id", ""),
                ) from None
            raise Failure(
                Stage.DECODE_LOST,
                f"{d_eng.engine_id}: {why(exc)}",
                transfer_id=headers.get("X-Request-Id", ""),
            ) from None

    def observe_ttft(self, started: float) -> None:
        self.ttft_s.append(time.monotonic() - started)
        self.metrics.ttft.observe(self.ttft_s[-1])


async def serve(settings: RouterSettings) -> None:
    router = Router(settings)
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    log.info("router_listening", host=settings.host, port=settings.port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
