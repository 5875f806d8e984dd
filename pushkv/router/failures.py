"""Every way a routed request can fail, and the HTTP answer each maps to (one place).

A client never gets a bare 500: each failure is a 429, 502, 503 or 504 whose
JSON body names the stage that failed, with ``Retry-After`` where a retry can
help. Failures that the decode engine can absorb (a lost prefill leg, an
unreachable coordinator) do not appear here when the decode engine's
on_transfer_failure is recompute (the default): the request is served by
fallback.
"""

from __future__ import annotations

import enum

from aiohttp import web


class Stage(enum.Enum):
    """(HTTP status, what the client is told failed, Retry-After seconds or 0)."""

    NO_ENGINE = (503, "no engine available", 1)
    COORDINATOR_UNAVAILABLE = (503, "coordinator unavailable", 1)
    OVERLOADED = (429, "too many transfers in flight", 1)
    PREFILL_LOST = (502, "prefill engine lost", 1)
    PREFILL_FAILED = (502, "prefill engine failed", 0)
    DECODE_LOST = (502, "decode engine lost", 1)
    DECODE_FAILED = (502, "decode engine failed", 0)
    TIMEOUT = (504, "timed out", 0)

    @property
    def status(self) -> int:
        return self.value[0]

    @property
    def label(self) -> str:
        return self.value[1]

    @property
    def retry_after_s(self) -> int:
        return self.value[2]


# The OpenAI-style error `type` of each HTTP status.
_TYPES = {429: "rate_limit_exceeded", 502: "bad_gateway", 503: "service_unavailable"}
_TYPES[504] = "gateway_timeout"


class Failure(Exception):
    """A request that cannot be served: raised inside the router, answered once."""

    def __init__(self, stage: Stage, detail: str = "", *, transfer_id: str = "") -> None:
        super().__init__(stage, detail)
        self.stage = stage
        self.detail = detail
        self.transfer_id = transfer_id  # the request's, where one was minted

    @property
    def name(self) -> str:
        return self.stage.name.lower()

    def log_fields(self) -> dict[str, str]:
        """Its fields in a log line: stage, detail, and transfer_id where known."""
        out = {"stage": self.name, "detail": self.detail}
        return out | ({"transfer_id": self.transfer_id} if self.transfer_id else {})

    def __str__(self) -> str:
        return f"{self.stage.label}: {self.detail}" if self.detail else self.stage.label

    def response(self) -> web.Response:
        stage = self.stage
        body = {
            "error": {
                "message": str(self),
                "type": _TYPES[stage.status],
                "code": stage.status,
                "stage": self.name,
            }
        }
        headers = {"Retry-After": str(stage.retry_after_s)} if stage.retry_after_s else None
        return web.json_response(body, status=stage.status, headers=headers)


def client_error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    """A request the router refuses on its own (bad JSON, too large, ...)."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )
