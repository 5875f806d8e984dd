"""pushkv/net/tls.py's channel options against a slow server: a coordinator that
answers the HTTP/2 handshake late (a busy event loop on a loaded host) must
still be reached; only a dead one may fail fast.

A proxy in front of a real gRPC server holds the server's first bytes (its
SETTINGS frame) for HOLD_S. gRPC treats ``grpc.min_reconnect_backoff_ms`` as
the minimum connect timeout, so setting it to 100 ms (as a past version of
OPTIONS did) makes every first call through such a proxy fail with
"connection attempt timed out before receiving SETTINGS frame"; the control
case proves the test sees that.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pushkv.net.tls import OPTIONS

HOLD_S = 1.0  # how late the server's handshake arrives: a loaded coordinator


def _pipe(src: socket.socket, dst: socket.socket, hold_first: float) -> None:
    first = True
    try:
        while data := src.recv(65536):
            if first and hold_first:
                time.sleep(hold_first)  # the fault: a late handshake, not synchronisation
            first = False
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def slow_address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(("127.0.0.1", port))
            threading.Thread(target=_pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=_pipe, args=(upstream, client, HOLD_S), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(5)
        listener.close()
        server.stop(0)


def _check(address: str, options: tuple[tuple[str, int], ...]) -> health_pb2.HealthCheckResponse:
    with grpc.insecure_channel(address, options=options) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp: health_pb2.HealthCheckResponse = stub.Check(
            health_pb2.HealthCheckRequest(), timeout=10 * HOLD_S
        )
        return resp


def test_a_late_handshake_is_waited_for(slow_address: str) -> None:
    assert _check(slow_address, OPTIONS).status == health_pb2.HealthCheckResponse.SERVING


def test_control_a_100ms_connect_timeout_fails_it(slow_address: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _check(slow_address, (*OPTIONS, ("grpc.min_reconnect_backoff_ms", 100)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
