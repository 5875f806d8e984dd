"""TLS material for every gRPC channel: one place to build server and client credentials.

Certificates are renewed in place (cert-manager's CSI driver rewrites the
mounted files), and every side follows them without a restart
(pushkv/net/tls_files.py reads the newest consistent set):

* a server (the coordinator) takes them for each new
  connection: gRPC's dynamic server credentials ask `_Fetcher` before every
  handshake;
* a client builds each new channel from them (`channel`, `aio_channel`), and
  `ChannelCache` replaces a cached channel made before they changed. A live
  connection keeps the session it has: TLS checks certificates at the
  handshake only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import grpc

from pushkv.net.tls_files import FileWatch, Material, watch

log = logging.getLogger("pushkv.tls")


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

    def _watch(self) -> FileWatch:
        files = watch(self.ca, self.cert, self.key)
        if not files.taken:  # once a set is taken, a file missing for a moment keeps it
            self.check()
        return files

    def material(self) -> Material:
        """The files' newest consistent contents (ValueError, naming what is
        wrong, when they were never readable as a set)."""
        return self._watch().current()

    def version(self) -> int:
        """Which set of the files' contents `material` gives now (grows by one
        each time they change)."""
        return self.material().version

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS: clients must present a certificate signed by the CA.
        Each new connection's handshake uses the files as they are then."""
        files = self._watch()
        first = files.current()
        # grpc-stubs leave out the None that keeps the current configuration.
        fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], _Fetcher(files, first))
        return grpc.dynamic_ssl_server_credentials(
            _server_config(first), fetcher, require_client_authentication=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        m = self.material()
        return grpc.ssl_channel_credentials(
            root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert
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


# Every pushkv server (the coordinator, a node relay) pings each client every
# `interval_s` and closes a connection whose ping goes unanswered for
# `timeout_s`: gRPC's own threads answer pings, with no Python, so an open
# agent stream means a live process even while that process starves its
# Python threads (CoreSettings.silent_agent_s), and a frozen or dead one is
# cut off within interval + timeout. Pings go on while a stream carries no
# data (max_pings_without_data 0). A client may ping as often as every 5 s:
# gRPC's default allows one ping in 5 minutes without data and answers more
# with a GOAWAY ("too_many_pings") that ends every stream on the connection.
PING_INTERVAL_S = 1.0
PING_TIMEOUT_S = 4.0


def server_ping_options(
    interval_s: float = PING_INTERVAL_S, timeout_s: float = PING_TIMEOUT_S
) -> tuple[tuple[str, int], ...]:
    return (
        ("grpc.keepalive_time_ms", max(100, int(interval_s * 1000))),
        ("grpc.keepalive_timeout_ms", max(100, int(timeout_s * 1000))),
        ("grpc.http2.max_pings_without_data", 0),
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


def _server_config(m: Material) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)


class _Fetcher:
    """gRPC calls it before every handshake of the server (on a thread of
    gRPC's own, aio servers too): a new configuration when the files changed
    since the last one it gave, else None (keep the current one)."""

    def __init__(self, files: FileWatch, first: Material) -> None:
        self._files = files
        self._served = first.version

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            m = self._files.current()
        except Exception:  # raised into gRPC's C core it would end the handshake
            log.exception("reading the TLS files failed: keeping the served certificate")
            return None
        if m.version == self._served:
            return None
        self._served = m.version
        return _server_config(m)


ChannelT = TypeVar("ChannelT", grpc.Channel, grpc.aio.Channel)


class ChannelCache(Generic[ChannelT]):
    """Channels by address, each made from the TLS files as they were: one made
    before the files changed is replaced at the next `get` and handed to
    `retire`, which closes it once the calls on it are done (a live call
    keeps its connection; new calls get a new one, with the new files)."""

    def __init__(
        self,
        make: Callable[[str], ChannelT],
        tls: TLSFiles | None,
        retire: Callable[[ChannelT], None],
    ) -> None:
        self._make: Callable[[str], ChannelT] = make
        self._tls = tls if tls is not None and tls.enabled else None
        self._retire: Callable[[ChannelT], None] = retire
        self._channels: dict[str, tuple[ChannelT, int]] = {}
        self.replaced = 0  # channels replaced because the files changed

    def get(self, address: str) -> ChannelT:
        version = self._tls.version() if self._tls is not None else 0
        held = self._channels.get(address)
        if held is not None:
            if held[1] == version:
                return held[0]
            self.replaced += 1
            self._retire(held[0])
        channel = self._make(address)
        self._channels[address] = (channel, version)
        return channel

    def take_all(self) -> list[ChannelT]:
        """Every channel held (to close them); the cache is empty after."""
        out = [c for c, _ in self._channels.values()]
        self._channels.clear()
        return out
