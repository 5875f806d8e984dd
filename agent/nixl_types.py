"""Plain values the NIXL boundary takes and hands back; no ``nixl`` import.

:class:`KVRegion` and :class:`MemoryKind` describe registered memory (as plain
integers: peer layouts travel over the wire as these, never as NIXL's pickled
descriptors); :class:`PeerKey` names a remote agent; :class:`TransferState`,
:class:`FailureReason` and :class:`NixlError` are what NIXL's strings and
binding exceptions become; :class:`WriteHandle` is a posted WRITE.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BlockResize",
    "BlockSlice",
    "FailureReason",
    "KVRegion",
    "MemoryKind",
    "NixlError",
    "PeerKey",
    "TransferState",
    "WriteHandle",
]


class TransferState(enum.Enum):
    """State of a posted transfer (NIXL's "PROC" / "DONE" / "ERR")."""

    IN_PROGRESS = "PROC"
    DONE = "DONE"
    FAILED = "ERR"


class FailureReason(enum.Enum):
    """Why a NIXL operation failed; carried by :class:`NixlError`."""

    PEER_DISCONNECTED = "peer_disconnected"  # nixlRemoteDisconnectError
    PEER_UNKNOWN = "peer_unknown"  # nixlNotFoundError: agent/registration unknown
    INVALID_REQUEST = "invalid_request"  # nixlInvalidParamError, or our own validation
    BACKEND_ERROR = "backend_error"  # nixlBackendError, backend/plugin unavailable
    REPOST_ACTIVE = "repost_active"  # nixlRepostActiveError
    METADATA_MISMATCH = "metadata_mismatch"  # nixlMismatchError, or wrong agent name
    TRANSFER_ERROR = "transfer_error"  # transfer()/check_xfer_state() returned "ERR"
    CANCELLED = "cancelled"  # nixlCancelledError, or released while in progress
    NOT_ALLOWED = "not_allowed"  # nixlNotAllowedError
    NOT_SUPPORTED = "not_supported"  # nixlNotSupportedError
    UNKNOWN = "unknown"  # nixlUnknownError and anything unmapped


class NixlError(Exception):
    """A NIXL operation failed; ``reason`` says why, ``message`` gives details."""

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(f"[{reason.name}] {message}")
        self.reason = reason
        self.message = message

    def __reduce__(self) -> tuple[type[NixlError], tuple[FailureReason, str]]:
        return (type(self), (self.reason, self.message))


class MemoryKind(enum.Enum):
    """Memory segment type of registered KV regions."""

    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True, slots=True)
class KVRegion:
    """One contiguous memory region holding ``num_blocks`` blocks of ``block_len`` bytes.

    For example one layer's K cache.  A KV cache is a tuple of regions; block id
    ``b`` of a transfer means block ``b`` in EVERY region.
    """

    base_addr: int
    block_len: int
    num_blocks: int
    device_id: int = 0

    @property
    def nbytes(self) -> int:
        return self.block_len * self.num_blocks


@dataclass(frozen=True, slots=True)
class BlockSlice:
    """A head range of a block, for engines of different TP sizes.

    The byte range ``[offset, offset + length)`` inside every block of the side
    whose blocks are larger (the same range in every region); the other side's
    blocks are whole and ``length`` bytes long.
    """

    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class BlockResize:
    """A token range between blocks of different sizes (prefill and decode
    engines with different block sizes, equal TP).

    Token ``k`` of the ``num_tokens`` moved is token ``first_token + k`` of the
    local blocks (``local_tokens`` tokens each) and token ``k`` of the remote
    blocks (``remote_tokens`` each). Both sides' blocks are ``kv_heads``
    heads one after another, a head's part of a block ``units`` spans one
    after another, span j its block's tokens in order, ``units[j]`` bytes
    each (empty: one span per head), so a token range of a span is
    contiguous.
    """

    local_tokens: int
    remote_tokens: int
    kv_heads: int
    first_token: int
    num_tokens: int
    units: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PeerKey:
    """A remote agent: its NIXL agent name plus the incarnation (changes on restart)."""

    agent_name: str
    incarnation: str


@dataclass(eq=False, slots=True)
class WriteHandle:
    """A posted WRITE.  Created only by :meth:`pushkv.agent.nixl_adapter.NixlEndpoint.post_write`.

    ``state`` is the last state observed by ``post_write`` or ``NixlEndpoint.poll``;
    ``failure`` is set once the transfer failed.  ``_xfer`` is NIXL's request
    handle, held and released only by the endpoint that posted it (``_owner``).
    ``posted_at`` / ``completed_at`` are :func:`time.monotonic` seconds;
    ``posted_at`` is taken on entry to ``post_write``, so latency includes
    building the request.
    """

    handle_id: int
    peer: PeerKey
    num_blocks: int
    nbytes: int
    num_descriptors: int
    notif: bytes
    posted_at: float
    state: TransferState
    completed_at: float | None = None
    failure: FailureReason | None = None
    released: bool = False
    _xfer: Any = field(default=None, repr=False)
    _owner: object = field(default=None, repr=False)

    @property
    def latency_s(self) -> float | None:
        """Seconds from post to the poll that saw DONE, or None if not done."""
        if self.completed_at is None:
            return None
        return self.completed_at - self.posted_at
