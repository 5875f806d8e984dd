"""Who is calling, and what they may do.

With mutual TLS every caller presents a certificate; its common name is the
identity:

  engine:<engine_id>   an engine (its agents and its connector's scheduler half):
                       agent stream, registrations and reports for that engine only
  router               BeginTransfer, Cancel, and the read-only status API
  Submit (a batch)     each call is authorized like its unary RPC
  operator:<name>      the read-only status API only

Without TLS (development mode) every caller is trusted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pushkv.controlplane.errors import PermissionDenied, Unauthenticated


class Kind(enum.Enum):
    TRUSTED = "trusted"  # no TLS configured: development mode
    ENGINE = "engine"
    ROUTER = "router"
    OPERATOR = "operator"

    __hash__ = object.__hash__  # members are singletons: identity hashing, in C


@dataclass(frozen=True, slots=True)
class Principal:
    kind: Kind
    name: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.name}" if self.name else self.kind.value


TRUSTED = Principal(Kind.TRUSTED)

# method prefix -> kinds allowed (TRUSTED is always allowed)
_METHODS: dict[str, frozenset[Kind]] = {
    "/pushkv.v1.AgentService/": frozenset({Kind.ENGINE}),
    "/pushkv.v1.TransferService/RegisterDecodeBlocks": frozenset({Kind.ENGINE}),
    "/pushkv.v1.TransferService/ReportPrefillDone": frozenset({Kind.ENGINE}),
    "/pushkv.v1.TransferService/BeginTransfer": frozenset({Kind.ROUTER}),
    "/pushkv.v1.TransferService/Cancel": frozenset({Kind.ROUTER, Kind.ENGINE}),
    # Each call of a batch is then checked against its unary method's rule.
    "/pushkv.v1.TransferService/Submit": frozenset({Kind.ROUTER, Kind.ENGINE}),
    "/pushkv.v1.StatusService/": frozenset({Kind.ENGINE, Kind.ROUTER, Kind.OPERATOR}),
}


def parse_identity(common_name: str) -> Principal:
    kind, _, name = common_name.partition(":")
    if kind == "engine" and name:
        return Principal(Kind.ENGINE, name)
    if kind == "router" and not name:
        return Principal(Kind.ROUTER)
    if kind == "operator" and name:
        return Principal(Kind.OPERATOR, name)
    raise Unauthenticated(
        f"certificate common name {common_name!r} is not engine:<id>, router or operator:<name>"
    )


def _allowed(kind: Kind, method: str) -> bool:
    for prefix, kinds in _METHODS.items():
        if method.startswith(prefix):
            return kind in kinds
    return True  # health and reflection are open to every authenticated caller


class Authorizer:
    def __init__(self, tls_enabled: bool) -> None:
        self.tls_enabled = tls_enabled
        # (kind, method) -> allowed; methods are the server's few (each Submit call checks one).
        self._allowed: dict[tuple[Kind, str], bool] = {}

    def principal(self, context: Any) -> Principal:
        if not self.tls_enabled:
            return TRUSTED
        auth = context.auth_context() or {}
        names = auth.get("x509_common_name") or []
        if not names:
            raise Unauthenticated("no client certificate")
        raw = names[0]
        return parse_identity(raw.decode() if isinstance(raw, bytes) else str(raw))

    def check_method(self, principal: Principal, method: str) -> None:
        kind = principal.kind
        if kind is Kind.TRUSTED:
            return
        allowed = self._allowed.get((kind, method))
        if allowed is None:
            allowed = self._allowed[(kind, method)] = _allowed(kind, method)
        if not allowed:
            raise PermissionDenied(f"{principal} may not call {method}")

    @staticmethod
    def require_engine(principal: Principal, engine_id: str, *, field: str) -> None:
        """An engine identity may act only for its own engine."""
        if principal.kind is Kind.ENGINE and principal.name != engine_id:
            raise PermissionDenied(f"{principal} may not act for engine {engine_id!r}", field=field)
