"""The NIXL boundary: importing NIXL and translating what it raises and returns.

:mod:`pushkv.agent.nixl_adapter` is the only user.  ``nixl`` is imported lazily, on
the first endpoint (``nixl_api``); before that import ``NIXL_LOG_LEVEL``
defaults to ``WARN`` (NIXL otherwise prints INFO lines to *stdout*).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from pushkv.agent.nixl_types import FailureReason, NixlError, TransferState

__all__ = [
    "INSTALL_HINT",
    "REASON_BY_EXC_NAME",
    "STATE_BY_STATUS",
    "is_nixl_exception",
    "logged_if_nixl_fails",
    "nixl_api",
    "quiet_nixl_env",
    "text",
    "translate",
]

_log = logging.getLogger("pushkv.agent.nixl")

REASON_BY_EXC_NAME: Final[Mapping[str, FailureReason]] = {
    "nixlRemoteDisconnectError": FailureReason.PEER_DISCONNECTED,
    "nixlNotFoundError": FailureReason.PEER_UNKNOWN,
    "nixlInvalidParamError": FailureReason.INVALID_REQUEST,
    "nixlBackendError": FailureReason.BACKEND_ERROR,
    "nixlRepostActiveError": FailureReason.REPOST_ACTIVE,
    "nixlMismatchError": FailureReason.METADATA_MISMATCH,
    "nixlCancelledError": FailureReason.CANCELLED,
    "nixlNotAllowedError": FailureReason.NOT_ALLOWED,
    "nixlNotSupportedError": FailureReason.NOT_SUPPORTED,
    "nixlNotPostedError": FailureReason.TRANSFER_ERROR,
    "nixlUnknownError": FailureReason.UNKNOWN,
}

STATE_BY_STATUS: Final[Mapping[str, TransferState]] = {s.value: s for s in TransferState}

INSTALL_HINT: Final = (
    "NIXL is not installed; CPU hosts: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
)


def _torch_without_cuda() -> bool:
    """Whether the torch installed here is a CPU build, or there is none: read
    from its ``version.py`` without importing torch. False when unsure."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    if spec is None:
        return True
    if not spec.origin:
        return False
    try:
        tree = ast.parse(Path(spec.origin).with_name("version.py").read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "cuda":
            value = getattr(node, "value", None)
            return isinstance(value, ast.Constant) and value.value is None
    return False


def _packages() -> tuple[str, ...]:
    """NIXL's packages, in the order to import them. The meta package ``nixl``
    loads the variant for the CUDA of the process's torch (or CUDA library);
    where none is loaded and the installed torch has no CUDA (a CPU host), it
    imports all of torch, seconds of CPU in each process, only to learn that,
    and then loads the first variant installed: that variant is loaded first
    there instead."""
    loaded = any(m in sys.modules for m in ("torch", "cuda.bindings", "cupy"))
    if not loaded and _torch_without_cuda():
        return ("nixl_cu13", "nixl_cu12", "nixl")
    return ("nixl", "nixl_cu13", "nixl_cu12")


@functools.cache
def nixl_api() -> Any:
    """Import and return NIXL's ``_api`` module (the meta package first, unless
    it could only pick the one installed variant: see ``_packages``)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    last: ImportError | None = None
    for package in _packages():
        try:
            return importlib.import_module(f"{package}._api")
        except ModuleNotFoundError as exc:
            if exc.name not in (package, f"{package}._api"):
                raise
            last = exc
        except ImportError as exc:  # e.g. meta package found CUDA but not its variant
            last = exc
    raise NixlError(FailureReason.BACKEND_ERROR, INSTALL_HINT) from last


def is_nixl_exception(exc: BaseException) -> bool:
    cls = type(exc)
    return cls.__name__ in REASON_BY_EXC_NAME or cls.__module__.endswith("._bindings")


def translate(
    exc: Exception,
    context: str,
    overrides: Mapping[FailureReason, FailureReason] | None = None,
) -> NixlError:
    """Turn a NIXL binding exception into a :class:`NixlError`; re-raise anything else."""
    if isinstance(exc, NixlError):
        return exc
    if not is_nixl_exception(exc):
        raise exc
    reason = REASON_BY_EXC_NAME.get(type(exc).__name__, FailureReason.UNKNOWN)
    if overrides:
        reason = overrides.get(reason, reason)
    return NixlError(reason, f"{context}: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def logged_if_nixl_fails(what: str) -> Iterator[None]:
    """Best effort: a NIXL failure inside is logged as "<what> failed"; others propagate."""
    try:
        yield
    except Exception as exc:
        if not is_nixl_exception(exc):
            raise
        _log.warning("%s failed: %s", what, exc)


def text(name: bytes | str) -> str:
    """An agent name as NIXL returns it (bytes or str, by binding version)."""
    return name.decode() if isinstance(name, bytes) else str(name)


def quiet_nixl_env(loopback: bool) -> dict[str, str]:
    """Environment variables for tests/benchmarks; set them before creating an endpoint.

    Args:
        loopback: also pin UCX to the loopback device (single-host runs).  Without
            it UCX may also route through the host's external address.

    Returns:
        A fresh dict: ``NIXL_LOG_LEVEL=WARN``, ``UCX_LOG_LEVEL=error`` and, with
        ``loopback``, ``UCX_NET_DEVICES=lo``.
    """
    env = {"NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}
    if loopback:
        env["UCX_NET_DEVICES"] = "lo"
    return env
