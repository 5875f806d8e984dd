"""What the router sends each engine for one request (the prefill and the
decode leg), and how a leg's failure reads in an answer or a log line."""

from __future__ import annotations

import json
from typing import Any

import structlog

from pushkv.router.failures import Failure, Stage

log = structlog.get_logger("pushkv.router")


class BadRequest(Exception):
    pass


def split_legs(
    body: dict[str, Any], transfer_id: str, chat: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build the prefill leg (one token, no stream) and the decode leg."""
    if "kv_transfer_params" in body:
        raise BadRequest("kv_transfer_params is set by the router, not by clients")
    if chat:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest("'messages' must be a non-empty list")
    elif not isinstance(body.get("prompt"), str | list) or not body["prompt"]:
        raise BadRequest("'prompt' must be a non-empty string or list")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise BadRequest(f"'{key}' must be a positive integer")
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill["max_tokens"] = 1
    if chat:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    decode = dict(body)
    decode["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": transfer_id}
    return prefill, decode


def prefill_failure(exc: BaseException, engine_id: str, timeout_s: float) -> Failure:
    if isinstance(exc, Failure):
        return exc
    if isinstance(exc, TimeoutError):
        return Failure(Stage.TIMEOUT, f"prefill leg after {timeout_s:g} s")
    return Failure(Stage.PREFILL_LOST, f"{engine_id}: {why(exc)}")


def prefill_lost(
    exc: BaseException, engine_id: str, transfer_id: str, timeout_s: float, recompute: bool
) -> tuple[Failure, str]:
    """A failed prefill leg: its Failure (logged once, as prefill_leg_failed)
    and the reason its transfer is cancelled with."""
    failure = prefill_failure(exc, engine_id, timeout_s)
    failure.transfer_id = failure.transfer_id or transfer_id
    log.warning("prefill_leg_failed", engine_id=engine_id, **failure.log_fields())
    outcome = "decode recomputes" if recompute else "request failed"
    return failure, f"prefill leg failed: {failure}"[:900] + f" ({outcome})"


def why(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def error_message(text: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the text's start."""
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:300]
    except (ValueError, AttributeError):
        pass
    return text[:300]
