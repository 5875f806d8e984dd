"""TLS material for every gRPC channel: one place to build server and client credentials."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files: the CA that signs peers, and this side's certificate and key."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def check(self) -> None:
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if not path:
                raise ValueError(f"TLS needs --tls-{name} as well (ca, cert and key)")
            if not Path(path).is_file():
                raise ValueError(f"TLS {name} file {path!r} does not exist")

    def _read(self) -> tuple[bytes, bytes, bytes]:
        self.check()
        return Path(self.ca).read_bytes(), Path(self.cert).read_bytes(), Path(self.key).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS: clients must present a certificate signed by the CA."""
        ca, cert, key = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    @classmethod
    def from_mapping(cls, m: Any, prefix: str = "tls_") -> TLSFiles:
        get = m.get if hasattr(m, "get") else (lambda k, d="": getattr(m, k, d))
        return cls(
            str(get(prefix + "ca", "") or ""),
            str(get(prefix + "cert", "") or ""),
            str(get(prefix + "key", "") or ""),
        )


# A restarted coordinator is found again within 2 s: gRPC's default reconnect
# backoff grows to 120 s, during which every call fails fast (UNAVAILABLE).
# Never set grpc.min_reconnect_backoff_ms: gRPC takes it as the minimum
# CONNECT TIMEOUT (default 20 s); at 100 ms a connection attempt to a busy
# coordinator on a loaded host timed out "before receiving SETTINGS frame" and
# whole bursts fell back to recompute (tests/test_wire_tls.py).
OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


# Every pushkv server (the coordinator, a node relay) pings an idle client
# every 10 s, so a dead peer is found without waiting on TCP, and lets a
# client ping it as often as every 5 s: gRPC's default allows one ping in
# 5 minutes without data and answers more with a GOAWAY ("too_many_pings")
# that ends every stream on the connection.
SERVER_PING_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


def channel(address: str, tls: TLSFiles | None = None) -> grpc.Channel:
    if tls is not None and tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=OPTIONS)
    return grpc.insecure_channel(address, options=OPTIONS)


def aio_channel(
    address: str, tls: TLSFiles | None = None, extra: tuple[tuple[str, int], ...] = ()
) -> grpc.aio.Channel:
    opts = OPTIONS + extra
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.aio.insecure_channel(address, options=opts)
