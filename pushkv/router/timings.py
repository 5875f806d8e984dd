"""When a front (the router, or a benchmark's proxy) saw each request's legs
answer: unix times per request id, served as JSON at ``GET /timings``.

Observability only, for `pushkv bench serving`'s critical path
(pushkv/bench/serving/critpath.py): the router stamps "prefill_response" when the
prefill leg's answer is read and "decode_first_byte" when the decode engine's
first streamed bytes reach it. Bounded: the oldest requests are forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from aiohttp import web

PREFILL_RESPONSE = "prefill_response"
DECODE_FIRST_BYTE = "decode_first_byte"
REMEMBER = 20_000  # requests


class FrontTimings:
    def __init__(self, limit: int = REMEMBER) -> None:
        self._limit = limit
        self._by_id: OrderedDict[str, dict[str, float]] = OrderedDict()

    def mark(self, request_id: str, name: str, at: float | None = None) -> None:
        """Record `name` for `request_id` (now, unless `at`); the first mark of a name stays."""
        if not request_id:
            return
        marks = self._by_id.get(request_id)
        if marks is None:
            marks = self._by_id[request_id] = {}
            if len(self._by_id) > self._limit:
                self._by_id.popitem(last=False)
        marks.setdefault(name, time.time() if at is None else at)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {rid: dict(m) for rid, m in self._by_id.items()}

    async def handler(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())
