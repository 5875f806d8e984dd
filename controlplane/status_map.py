"""The one place where domain errors become gRPC status codes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from pushkv.controlplane import errors
from pushkv.controlplane.auth import Authorizer
from pushkv.controlplane.leadership import LEADER_METADATA_KEY, Leadership, NotLeader

log = structlog.get_logger("pushkv.coordinator")

# A request stream refused before it was read (a standby's, say) waits this
# long at most for the client's first message, then refuses: a grpc.aio
# client whose first send finds the call already ended reports INTERNAL
# "Internal error from Core" instead of the status and its metadata (the
# leader a standby names), as a node relay's NodeStream would.
FIRST_MESSAGE_WAIT_S = 1.0

_CODES: dict[type[errors.PushKVError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Conflict: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def code_for(exc: errors.PushKVError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.UNKNOWN


def outcome(exc: BaseException, rpc: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers (a unary RPC, or one
    call of a Submit batch). Anything but a domain error is logged as a bug."""
    if isinstance(exc, errors.PushKVError):
        return code_for(exc), str(exc)
    if isinstance(exc, NotLeader):
        # UNAVAILABLE: every client already retries it, and nothing was recorded.
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    log.error("rpc_failed", rpc=rpc, exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error (see coordinator log)"


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException, rpc: str) -> None:
    code, message = outcome(exc, rpc)
    if isinstance(exc, NotLeader):
        await context.abort(code, message, ((LEADER_METADATA_KEY, exc.leader),))
    await context.abort(code, message)


class _Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A deserializer that never raises: grpc would answer UNKNOWN for that."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return _Undecodable(str(exc) or type(exc).__name__)

    return parse


def _check(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise errors.InvalidArgument(f"undecodable request message: {request.error}")


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        _check(request)
        yield request


def _wrap_unary(
    fn: Callable[..., Awaitable[Any]], rpc: str, authz: Authorizer, gate: Leadership
) -> Callable[..., Awaitable[Any]]:
    async def behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            authz.check_method(authz.principal(context), rpc)
            gate.check_write(rpc)
            _check(request)
            return await fn(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort(context, exc, rpc)

    return behavior


def _wrap_stream(
    fn: Callable[..., AsyncIterator[Any]],
    rpc: str,
    authz: Authorizer,
    gate: Leadership,
    *,
    request_stream: bool = False,
) -> Callable[..., Any]:
    async def behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        started = False  # the handler began reading the requests
        try:
            authz.check_method(authz.principal(context), rpc)
            gate.check_write(rpc)
            if request_stream:
                request = _checked(request)
            else:
                _check(request)
            started = True
            async for item in fn(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            if request_stream and not started:
                await _first_message(request)
            await _abort(context, exc, rpc)

    return behavior


async def _first_message(requests: Any) -> None:
    """Read (and drop) a refused request stream's first message, bounded."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(anext(aiter(requests)), FIRST_MESSAGE_WAIT_S)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Wraps every pushkv handler: checks the caller may call the method, that
    this replica leads if the method writes (controlplane/leadership.py), and
    turns a domain error into its status code."""

    def __init__(self, authz: Authorizer | None = None, gate: Leadership | None = None) -> None:
        self._authz = authz or Authorizer(tls_enabled=False)
        self._gate = gate or Leadership()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        rpc = handler_call_details.method
        if handler is None or not rpc.startswith("/pushkv."):
            return handler  # health and reflection map their own errors
        ser = {
            "request_deserializer": _lenient(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, rpc, self._authz, self._gate), **ser
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, rpc, self._authz, self._gate),  # type: ignore[arg-type]
                **ser,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(
                    handler.stream_stream,  # type: ignore[arg-type]
                    rpc,
                    self._authz,
                    self._gate,
                    request_stream=True,
                ),
                **ser,
            )
        return handler
