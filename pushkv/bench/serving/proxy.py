"""The proxies in front of vLLM's NIXL connectors, as the standard 1P1D flows run them.

Each runs as its own process (``python -m pushkv.bench.serving proxy``), like the
pushkv router in front of pushkv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from pushkv.bench.serving.config import PREFILL_ENGINE_ID
from pushkv.router.timings import DECODE_FIRST_BYTE, PREFILL_RESPONSE, FrontTimings


class Proxy:
    """The standard 1P1D proxy flows for vLLM's NIXL connectors.

    pull: POST the prefill leg (max_tokens 1, do_remote_decode), wait for its
          response, relay its kv_transfer_params to the decode leg, stream that.
    push: POST both legs at once; the decode leg carries the prefill engine's
          coordinates and the shared request id (X-Request-Id on both legs).
    """

    def __init__(
        self,
        mode: str,
        prefill: str,
        decode: str,
        prefill_engine_id: str,
        side_port: int,
        side_host: str = "127.0.0.1",
    ) -> None:
        self.mode = mode
        self.side_host = side_host
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.prefill_engine_id = prefill_engine_id
        self.side_port = side_port
        self._http: aiohttp.ClientSession | None = None
        self.timings = FrontTimings()  # GET /timings, as the pushkv router's

    async def _start(self, app: web.Application) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600, connect=10))

    async def _stop(self, app: web.Application) -> None:
        if self._http is not None:
            await self._http.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/timings", self.timings.handler)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"mode": self.mode})

    def _prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        p = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        p.update(max_tokens=1, stream=False)
        p["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return p

    async def _post_prefill(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        assert self._http is not None
        async with self._http.post(
            self.prefill + "/v1/completions", json=self._prefill_body(body), headers=headers
        ) as r:
            text = await r.text()
            self.timings.mark(headers["X-Request-Id"], PREFILL_RESPONSE)
            if r.status != 200:
                raise RuntimeError(f"prefill answered {r.status}: {text[:200]}")
            out: dict[str, Any] = json.loads(text)
            return out

    async def _relay_decode(
        self, request: web.Request, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        assert self._http is not None
        async with self._http.post(
            self.decode + "/v1/completions", json=body, headers=headers
        ) as resp:
            if not body.get("stream"):
                return web.Response(
                    body=await resp.read(), status=resp.status, content_type=resp.content_type
                )
            response = web.StreamResponse(status=resp.status)
            response.content_type = resp.content_type or "text/event-stream"
            response.headers["Cache-Control"] = "no-cache"
            await response.prepare(request)
            first = True
            async for chunk in resp.content.iter_any():
                if first:
                    self.timings.mark(headers["X-Request-Id"], DECODE_FIRST_BYTE)
                    first = False
                await response.write(chunk)
            await response.write_eof()
            return response

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        if self.mode == "pull":
            try:
                pre = await self._post_prefill(body, headers)
            except (RuntimeError, aiohttp.ClientError, ValueError) as exc:
                return web.json_response({"error": str(exc)}, status=502)
            params = pre.get("kv_transfer_params")
            if not isinstance(params, dict):
                return web.json_response({"error": "no kv_transfer_params"}, status=502)
            return await self._relay_decode(
                request, {**body, "kv_transfer_params": params}, headers
            )

        decode_body = {
            **body,
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.prefill_engine_id,
                "remote_host": self.side_host,
                "remote_port": self.side_port,
                "tp_size": 1,
                "pp_size": 1,
                "remote_request_id": rid,
            },
        }
        handler = asyncio.current_task()
        p_task = asyncio.create_task(self._post_prefill(body, headers))

        def prefill_done(t: asyncio.Task[dict[str, Any]]) -> None:
            # A failed prefill leg would leave the decode leg waiting for a whole
            # registration timeout: abort it (the client sees a failure).
            if not t.cancelled() and t.exception() is not None and handler is not None:
                handler.cancel()

        p_task.add_done_callback(prefill_done)
        try:
            return await self._relay_decode(request, decode_body, headers)
        finally:
            if not p_task.done():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(p_task, 60)


async def _serve_proxy(proxy: Proxy, port: int) -> None:
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def proxy_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_serving proxy")
    ap.add_argument("--mode", choices=["pull", "push"], required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--prefill-engine-id", default=PREFILL_ENGINE_ID)
    ap.add_argument("--prefill-side-port", type=int, default=0)
    ap.add_argument(
        "--prefill-side-host",
        default="127.0.0.1",
        help="the prefill's NIXL side channel address as the decode engine reaches it",
    )
    a = ap.parse_args(argv)
    proxy = Proxy(
        a.mode, a.prefill, a.decode, a.prefill_engine_id, a.prefill_side_port, a.prefill_side_host
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_proxy(proxy, a.port))
    return 0
