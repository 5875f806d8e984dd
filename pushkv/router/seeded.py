"""The router's first-token flow (pushkv/router/first_token.py shapes the
bodies): the prefill leg first; its token goes to the client at once; then the
decode leg, seeded with that token, continues the answer.

The decode leg leaves when the prefill answers, so the decode engine
allocates its blocks then, not while the prefill computes: the prefill's
blocks wait for it (the rendezvous takes the two sides in either order), and
the push runs as soon as the decode side registers. TTFT no longer waits for
the transfer or the decode engine; the second token does.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from pushkv.router import first_token as ft
from pushkv.router.engines import Engine
from pushkv.router.failures import Failure, Stage
from pushkv.router.legs import error_message, prefill_failure, prefill_lost, split_legs, why
from pushkv.router.timings import DECODE_FIRST_BYTE, PREFILL_RESPONSE

if TYPE_CHECKING:
    from pushkv.router.app import Router

log = structlog.get_logger("pushkv.router")

COMPLETIONS = "/v1/completions"


async def prefill_alone(
    router: Router, request: web.Request, body: dict[str, Any], chat: bool, p_eng: Engine
) -> web.StreamResponse:
    """A request of one token: the prefill engine answers it whole, with no
    transfer and no decode leg."""
    out = ft.prefill_body(body, chat, None)
    out["return_token_ids"] = bool(body.get("return_token_ids"))
    started = time.monotonic()
    try:
        async with router.post(p_eng.url + request.path, out, {}, "prefill") as resp:
            data, status = await resp.read(), resp.status
    except Exception as exc:  # aiohttp.ClientError, OSError, TimeoutError
        raise prefill_failure(exc, p_eng.engine_id, router.settings.leg_timeout_s) from None
    router.observe_ttft(started)
    if status != 200 or not body.get("stream"):
        return web.Response(body=data, status=status, content_type="application/json")
    first = ft.FirstToken(json.loads(data), chat)
    return await _stream_first_only(router, request, first, body, chat)


async def _stream_first_only(
    router: Router, request: web.Request, first: ft.FirstToken, body: dict[str, Any], chat: bool
) -> web.StreamResponse:
    response = await _open_stream(request)
    chunks = ft.first_chunks(first, body, chat)
    chunks[-1]["choices"][0]["finish_reason"] = first.finish_reason
    chunks[-1]["choices"][0]["stop_reason"] = first.stop_reason
    for chunk in chunks:
        await response.write(ft.sse(chunk))
    opts = body.get("stream_options") or {}
    if isinstance(opts, dict) and opts.get("include_usage"):
        usage = first.answer.get("usage")
        head = {k: chunks[-1][k] for k in ("id", "object", "created", "model")}
        await response.write(ft.sse({**head, "choices": [], "usage": usage}))
    await response.write(ft.DONE)
    await response.write_eof()
    return response


async def _open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(request)
    return response


async def seeded(
    router: Router,
    request: web.Request,
    transfer_id: str,
    p_eng: Engine,
    d_eng: Engine,
    body: dict[str, Any],
    chat: bool,
) -> web.StreamResponse:
    """Serve one request whose first token comes from the prefill (the
    transfer is begun). Whatever way it ends, the transfer ends: completed by
    the decode leg, or cancelled here."""
    started = time.monotonic()
    headers = {"X-Request-Id": transfer_id}
    budget = ft.max_tokens(body, chat)
    settled = False  # the transfer is completed or cancelled by now
    try:
        if router.on_dispatch is not None:
            await router.on_dispatch(transfer_id, "dispatched")
        try:
            pbody = ft.prefill_body(body, chat, transfer_id)
            text, status = await _prefill_answer(router, request, p_eng, pbody, headers)
            router.timings.mark(transfer_id, PREFILL_RESPONSE)
            if 400 <= status < 500:
                # The engine refused the request itself (validation): its answer is the client's.
                return web.Response(text=text, status=status, content_type="application/json")
            if status != 200:
                raise Failure(Stage.PREFILL_FAILED, f"HTTP {status}: {error_message(text)}")
            try:
                first = ft.FirstToken(json.loads(text), chat)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise Failure(Stage.PREFILL_FAILED, f"its answer: {why(exc)}") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure, reason = prefill_lost(
                exc, p_eng.engine_id, transfer_id, router.settings.leg_timeout_s, d_eng.recompute
            )
            await router.cancel(transfer_id, reason)
            settled = True
            if not d_eng.recompute:
                raise failure from None
            # Nothing was sent to the client yet: the decode engine serves it whole.
            return await router.decode_alone(request, body, d_eng, "prefill_failed", transfer_id)
        if first.finished(budget):
            await router.cancel(transfer_id, "the request ended at its first token")
            settled = True
            router.observe_ttft(started)
            if body.get("stream"):
                return await _stream_first_only(router, request, first, body, chat)
            return web.json_response(ft.first_only(first, body, chat))
        if not first.whole:
            # Its text is not the client's yet: the decode engine answers from
            # token 1 (the prefill's KV is pushed all the same).
            router.metrics.fallbacks.labels("first_token_not_whole").inc()
            _, whole_body = split_legs(body, transfer_id, chat)
            response, settled = await router.relay(request, d_eng, whole_body, headers, started)
            return response
        dbody = ft.decode_body(body, chat, transfer_id, first, budget)
        if body.get("stream"):
            response, settled = await _stream(
                router, request, d_eng, dbody, first, body, chat, started
            )
            return response
        answer = await _decode_answer(router, d_eng, dbody, headers)
        settled = True
        router.observe_ttft(started)
        return web.json_response(ft.stitched(first, answer, body, chat))
    finally:
        if not settled:
            # Client gone or the decode leg failed: release both sides' KV now.
            router.spawn(router.cancel(transfer_id, "client disconnected or decode failed"))


# Refreshes of the engine list in a row that must miss the prefill engine
# before its leg is given up (one miss may be a coordinator that restarted
# and has not heard from the agents yet).
GONE_REFRESHES = 2


async def _prefill_answer(
    router: Router,
    request: web.Request,
    p_eng: Engine,
    pbody: dict[str, Any],
    headers: dict[str, str],
) -> tuple[str, int]:
    """The prefill leg's answer (text, status). Given up when the coordinator
    stops listing the prefill engine (a hung or dead engine: its agents' lease
    lapsed): no decode leg exists yet to fall back from, and the client would
    otherwise wait for the leg timeout."""

    async def answer() -> tuple[str, int]:
        async with router.post(p_eng.url + request.path, pbody, headers, "prefill") as resp:
            return await resp.text(), resp.status

    async def gone() -> None:
        missed = 0
        while missed < GONE_REFRESHES:
            await asyncio.sleep(router.settings.refresh_s)
            missed = 0 if p_eng.engine_id in router.directory.prefill else missed + 1

    leg, watch = asyncio.ensure_future(answer()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({leg, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (leg, watch):
            if not task.done():
                task.cancel()
    if not leg.done() or leg.cancelled():
        raise Failure(
            Stage.PREFILL_LOST,
            f"{p_eng.engine_id}: no longer listed by the coordinator (its agents' lease lapsed)",
        )
    return leg.result()


async def _decode_answer(
    router: Router, d_eng: Engine, dbody: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    tid = headers["X-Request-Id"]
    try:
        async with router.post(d_eng.url + COMPLETIONS, dbody, headers, "decode") as resp:
            text, status = await resp.text(), resp.status
    except TimeoutError:
        raise Failure(
            Stage.TIMEOUT, f"decode leg after {router.settings.leg_timeout_s:g} s", transfer_id=tid
        ) from None
    except Exception as exc:
        detail = f"{d_eng.engine_id}: {why(exc)}"
        raise Failure(Stage.DECODE_LOST, detail, transfer_id=tid) from None
    router.timings.mark(tid, DECODE_FIRST_BYTE)
    if status != 200:
        raise Failure(
            Stage.DECODE_FAILED,
            f"{d_eng.engine_id}: HTTP {status}: {error_message(text)}",
            transfer_id=tid,
        )
    answer: dict[str, Any] = json.loads(text)
    return answer


async def _stream(
    router: Router,
    request: web.Request,
    d_eng: Engine,
    dbody: dict[str, Any],
    first: ft.FirstToken,
    body: dict[str, Any],
    chat: bool,
    started: float,
) -> tuple[web.StreamResponse, bool]:
    """Token 1 to the client now, then the decode leg's stream; (response,
    whether the decode leg ended with [DONE])."""
    tid = dbody["kv_transfer_params"]["transfer_id"]
    response = await _open_stream(request)
    for chunk in ft.first_chunks(first, body, chat):
        await response.write(ft.sse(chunk))
    router.observe_ttft(started)
    done = False
    try:
        async with router.post(
            d_eng.url + COMPLETIONS, dbody, {"X-Request-Id": tid}, "decode"
        ) as resp:
            if resp.status != 200:
                text = await resp.text()
                raise Failure(Stage.DECODE_FAILED, f"HTTP {resp.status}: {error_message(text)}")
            buf = b""
            marked = False
            async for data in resp.content.iter_any():
                if not marked:
                    router.timings.mark(tid, DECODE_FIRST_BYTE)
                    marked = True
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    done = await _relay_event(response, event, first, chat) or done
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        detail = str(exc) if isinstance(exc, Failure) else why(exc)
        log.warning(
            "decode_stream_broke", transfer_id=tid, engine_id=d_eng.engine_id, detail=detail
        )
    if not done:
        # The client holds token 1 already: the stream ends with an error
        # event (and no [DONE]), never silently short.
        await response.write(
            ft.sse_error(f"decode engine {d_eng.engine_id} failed after the first token", 502)
        )
    await response.write_eof()
    return response, done


async def _relay_event(
    response: web.StreamResponse, event: bytes, first: ft.FirstToken, chat: bool
) -> bool:
    """One SSE event of the decode leg to the client; True at [DONE]."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            await response.write(ft.DONE)
            return True
        parsed = json.loads(payload)
        if isinstance(parsed, dict) and "error" in parsed:
            raise Failure(Stage.DECODE_FAILED, error_message(payload.decode()))
        await response.write(ft.sse(ft.decode_chunk(parsed, first, chat)))
    return False
