"""Typed adapter over NIXL: the only module in pushkv that imports ``nixl``.

Everything NIXL hands back as strings ("DONE"/"PROC"/"ERR"), bytes-or-str names
and untyped binding exceptions is converted here, once, into
:class:`TransferState`, :class:`FailureReason` and :class:`NixlError`.

Threading: a :class:`NixlEndpoint` is owned by ONE thread (the agent's NIXL
thread).  The agent is created with the default ``sync_mode`` (no internal
locking), and two threads calling one agent crash the process (UCX assertion
or segfault).  The GIL is released inside NIXL calls, so a dedicated NIXL
thread does not starve the rest of the process.

Environment: ``nixl`` is imported lazily, on the first endpoint.  Before that
import ``NIXL_LOG_LEVEL`` defaults to ``WARN`` (NIXL otherwise prints INFO
lines to *stdout*).  ``UCX_NET_DEVICES`` is deliberately NOT set here:
production uses real NICs.  Single-host tests and benchmarks should export
:func:`quiet_nixl_env` ``(loopback=True)`` (``UCX_NET_DEVICES=lo``) before the
first endpoint is created, in every process.  Note that importing nixl
configures the ``nixl`` stdlib logger (stdout handler) and sets
``logging.raiseExceptions = False`` process-wide.

Wire safety: peer memory layouts are passed in as plain integers
(:class:`KVRegion`); NIXL's pickle-based ``get_serialized_descs`` /
``deserialize_descs`` are never used.
"""

from __future__ import annotations

import enum
import functools
import importlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Self

import numpy as np
import numpy.typing as npt

__all__ = [
    "FailureReason",
    "KVRegion",
    "MemoryKind",
    "NixlEndpoint",
    "NixlError",
    "PeerKey",
    "TransferState",
    "WriteHandle",
    "merge_runs",
    "quiet_nixl_env",
]

_log = logging.getLogger(__name__)

#: UCX backend parameters used unless the caller overrides them.  Error mode
#: "none" lets a WRITE carrying a notification complete on the initiator's
#: progress alone (in "peer" mode it waits for the target to progress) and cuts
#: small-message latency ~10x.  Peer death is still reported as
#: NIXL_ERR_REMOTE_DISCONNECT.  Both sides must use the same mode.
DEFAULT_UCX_PARAMS: Final[Mapping[str, str]] = {"ucx_error_handling_mode": "none"}


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


# --------------------------------------------------------------------------- types


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
class PeerKey:
    """A remote agent: its NIXL agent name plus the incarnation (changes on restart)."""

    agent_name: str
    incarnation: str


@dataclass(eq=False, slots=True)
class WriteHandle:
    """A posted WRITE.  Created only by :meth:`NixlEndpoint.post_write`.

    ``state`` is the last state observed by :meth:`NixlEndpoint.post_write` or
    :meth:`NixlEndpoint.poll`; ``failure`` is set once the transfer failed.
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


# --------------------------------------------------------------------------- pure helpers


def merge_runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge paired block ids into runs that are consecutive on BOTH sides.

    Returns ``(local_start, remote_start, length)`` tuples in input order.  A new
    run starts whenever either side's id is not its predecessor plus one.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(local) != len(remote):
        raise ValueError(
            f"local and remote block lists differ in length ({len(local)} vs {len(remote)})"
        )
    if not len(local):
        return []
    starts_l, starts_r, lengths = _find_runs(_int_list(local), _int_list(remote))
    return list(zip(starts_l, starts_r, lengths or [1] * len(starts_l), strict=True))


_U64 = npt.NDArray[np.uint64]
_I64 = npt.NDArray[np.int64]

#: From this many blocks on (unless they form one run on both sides),
#: validation and run merging are vectorized.  Each numpy call costs 1-3 µs on
#: the 2-vCPU VM, so one Python pass (about 6 µs for 64 ids) wins below this.
_VECTOR_MIN_BLOCKS: Final = 128
#: Up to this many descriptors the rows are built as Python tuples.
_PY_ROWS_MAX: Final = 64


@dataclass(frozen=True, slots=True)
class _Layout:
    """Regions of one side, pre-split for descriptor building."""

    regions: tuple[KVRegion, ...]
    triples: tuple[tuple[int, int, int], ...]  # (base_addr, block_len, device_id)
    bases: _U64
    block_lens: _U64
    devices: _U64
    max_blocks: int  # ids must be < this in every region
    bytes_per_block: int  # one block id, summed over all regions

    @classmethod
    def of(cls, regions: Sequence[KVRegion], what: str) -> _Layout:
        regs = tuple(regions)
        if not regs:
            raise NixlError(FailureReason.INVALID_REQUEST, f"{what}: no KV regions given")
        for i, r in enumerate(regs):
            if r.base_addr <= 0 or r.block_len <= 0 or r.num_blocks < 0 or r.device_id < 0:
                raise NixlError(
                    FailureReason.INVALID_REQUEST, f"{what}: region {i} is invalid: {r}"
                )
        return cls(
            regions=regs,
            triples=tuple((r.base_addr, r.block_len, r.device_id) for r in regs),
            bases=np.array([r.base_addr for r in regs], dtype=np.uint64),
            block_lens=np.array([r.block_len for r in regs], dtype=np.uint64),
            devices=np.array([r.device_id for r in regs], dtype=np.uint64),
            max_blocks=min(r.num_blocks for r in regs),
            bytes_per_block=sum(r.block_len for r in regs),
        )

    def rows(
        self, starts: Sequence[int], lengths: Sequence[int] | None
    ) -> list[tuple[int, int, int]]:
        """Runs (``lengths`` None: all of length 1) -> (addr, len, dev) rows, region-major."""
        if lengths is None:
            return [(b + s * bl, bl, d) for b, bl, d in self.triples for s in starts]
        return [
            (b + s * bl, n * bl, d)
            for b, bl, d in self.triples
            for s, n in zip(starts, lengths, strict=True)
        ]

    def descriptors(self, starts: _U64, lengths: _U64) -> _U64:
        """Same as :meth:`rows` for run arrays, as an Nx3 uint64 array."""
        out = np.empty((len(self.regions), len(starts), 3), dtype=np.uint64)
        out[:, :, 0] = self.bases[:, None] + starts[None, :] * self.block_lens[:, None]
        out[:, :, 1] = lengths[None, :] * self.block_lens[:, None]
        out[:, :, 2] = self.devices[:, None]
        return out.reshape(-1, 3)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Descriptor rows of one WRITE, ready for ``get_xfer_descs``."""

    local_rows: list[tuple[int, int, int]] | _U64
    remote_rows: list[tuple[int, int, int]] | _U64
    num_descriptors: int
    nbytes: int


def _check_pairing(local: _Layout, remote: _Layout, peer: PeerKey) -> None:
    if len(local.regions) != len(remote.regions):
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"peer {peer.agent_name!r} has {len(remote.regions)} KV regions, "
            f"local has {len(local.regions)}; regions pair up by index",
        )
    for i, (lr, rr) in enumerate(zip(local.regions, remote.regions, strict=True)):
        if lr.block_len != rr.block_len:
            raise NixlError(
                FailureReason.INVALID_REQUEST,
                f"peer {peer.agent_name!r} region {i} has block_len {rr.block_len}, "
                f"local region {i} has {lr.block_len}",
            )


def _range_error(side: str, lo: int, hi: int, limit: int) -> NixlError | None:
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        return NixlError(
            FailureReason.INVALID_REQUEST, f"{side} block id {bad} out of range [0, {limit})"
        )
    return None


def _int_list(ids: Sequence[int]) -> list[int]:
    if type(ids) is list:
        return ids
    arr: object = ids
    if isinstance(arr, np.ndarray):
        return [int(b) for b in arr.tolist()]
    return list(ids)


def _find_runs(lb: list[int], rb: list[int]) -> tuple[list[int], list[int], list[int] | None]:
    """One pass: (local starts, remote starts, lengths or None when every run is 1 long)."""
    ls: list[int] = []
    rs: list[int] = []
    ns: list[int] = []
    pl = pr = -2
    k = 0
    for a, b in zip(lb, rb, strict=True):
        if a == pl + 1 and b == pr + 1:
            k += 1
        else:
            if k:
                ns.append(k)
            ls.append(a)
            rs.append(b)
            k = 1
        pl, pr = a, b
    ns.append(k)
    return ls, rs, (None if len(ns) == len(lb) else ns)


def _plan_runs(
    local: _Layout,
    remote: _Layout,
    l_starts: list[int],
    r_starts: list[int],
    lengths: list[int] | None,
    num_blocks: int,
) -> _Plan:
    num_descriptors = len(l_starts) * len(local.regions)
    nbytes = num_blocks * local.bytes_per_block
    if num_descriptors <= _PY_ROWS_MAX:
        return _Plan(
            local.rows(l_starts, lengths),
            remote.rows(r_starts, lengths),
            num_descriptors,
            nbytes,
        )
    lens: _U64 = (
        np.ones(len(l_starts), dtype=np.uint64)
        if lengths is None
        else np.array(lengths, dtype=np.uint64)
    )
    return _Plan(
        local.descriptors(np.array(l_starts, dtype=np.uint64), lens),
        remote.descriptors(np.array(r_starts, dtype=np.uint64), lens),
        num_descriptors,
        nbytes,
    )


def _plan_write(
    local: _Layout,
    remote: _Layout,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    remote_side: str,
    *,
    vector_min: int | None = None,
) -> _Plan:
    """Validate block ids and build merged descriptor rows (one per region per run).

    This runs inside every timed WRITE, so it is written for speed: one run on
    both sides (the common contiguous case) is recognised with two C-level list
    comparisons; fewer than ``vector_min`` (default :data:`_VECTOR_MIN_BLOCKS`)
    ids go through one Python pass; more are vectorized.

    Raises:
        NixlError: INVALID_REQUEST for a length mismatch, an id out of range or a
            duplicate remote id.
    """
    n = len(local_blocks)
    if n != len(remote_blocks):
        raise NixlError(
            FailureReason.INVALID_REQUEST,
            f"write to {remote_side}: {n} local blocks vs {len(remote_blocks)} remote blocks",
        )
    if n == 0:
        return _Plan([], [], 0, 0)
    lb = _int_list(local_blocks)
    rb = _int_list(remote_blocks)
    l0, r0 = lb[0], rb[0]
    if (
        lb[-1] - l0 == n - 1
        and rb[-1] - r0 == n - 1
        and lb == list(range(l0, l0 + n))
        and rb == list(range(r0, r0 + n))
    ):  # one run on both sides; its ids are distinct by construction
        err = _range_error("local", l0, l0 + n - 1, local.max_blocks)
        err = err or _range_error(remote_side, r0, r0 + n - 1, remote.max_blocks)
        if err is not None:
            raise err
        return _plan_runs(local, remote, [l0], [r0], [n], n)
    if n < (_VECTOR_MIN_BLOCKS if vector_min is None else vector_min):
        err = _range_error("local", min(lb), max(lb), local.max_blocks)
        err = err or _range_error(remote_side, min(rb), max(rb), remote.max_blocks)
        if err is None and len(set(rb)) != n:
            err = NixlError(
                FailureReason.INVALID_REQUEST, f"write to {remote_side}: duplicate remote block ids"
            )
        if err is not None:
            raise err
        l_starts, r_starts, lengths = _find_runs(lb, rb)
        return _plan_runs(local, remote, l_starts, r_starts, lengths, n)

    la: _I64 = np.asarray(lb, dtype=np.int64)
    ra: _I64 = np.asarray(rb, dtype=np.int64)
    err = _range_error("local", int(la.min()), int(la.max()), local.max_blocks)
    err = err or _range_error(remote_side, int(ra.min()), int(ra.max()), remote.max_blocks)
    if err is None and np.unique(ra).size != n:
        err = NixlError(
            FailureReason.INVALID_REQUEST, f"write to {remote_side}: duplicate remote block ids"
        )
    if err is not None:
        raise err
    # A run starts where either side's id is not its predecessor + 1.
    brk = np.ones(n, dtype=bool)
    brk[1:] = (la[1:] != la[:-1] + 1) | (ra[1:] != ra[:-1] + 1)
    starts = np.flatnonzero(brk)
    run_lens = np.diff(np.append(starts, n)).astype(np.uint64)
    return _Plan(
        local.descriptors(la[starts].astype(np.uint64), run_lens),
        remote.descriptors(ra[starts].astype(np.uint64), run_lens),
        len(starts) * len(local.regions),
        n * local.bytes_per_block,
    )


# --------------------------------------------------------------------------- nixl boundary

_REASON_BY_EXC_NAME: Final[Mapping[str, FailureReason]] = {
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

_STATE_BY_STATUS: Final[Mapping[str, TransferState]] = {s.value: s for s in TransferState}

_INSTALL_HINT: Final = (
    "NIXL is not installed; CPU hosts: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
)


@functools.cache
def _nixl_api() -> Any:
    """Import and return NIXL's ``_api`` module (meta package first, then a variant)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    last: ImportError | None = None
    for package in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            return importlib.import_module(f"{package}._api")
        except ModuleNotFoundError as exc:
            if exc.name not in (package, f"{package}._api"):
                raise
            last = exc
        except ImportError as exc:  # e.g. meta package found CUDA but not its variant
            last = exc
    raise NixlError(FailureReason.BACKEND_ERROR, _INSTALL_HINT) from last


def _is_nixl_exception(exc: BaseException) -> bool:
    cls = type(exc)
    return cls.__name__ in _REASON_BY_EXC_NAME or cls.__module__.endswith("._bindings")


def _translate(
    exc: Exception,
    context: str,
    overrides: Mapping[FailureReason, FailureReason] | None = None,
) -> NixlError:
    """Turn a NIXL binding exception into a :class:`NixlError`; re-raise anything else."""
    if isinstance(exc, NixlError):
        return exc
    if not _is_nixl_exception(exc):
        raise exc
    reason = _REASON_BY_EXC_NAME.get(type(exc).__name__, FailureReason.UNKNOWN)
    if overrides:
        reason = overrides.get(reason, reason)
    return NixlError(reason, f"{context}: {type(exc).__name__}: {exc}")


@dataclass(frozen=True, slots=True)
class _Peer:
    key: PeerKey
    layout: _Layout
    mem_type: str


# --------------------------------------------------------------------------- endpoint


class NixlEndpoint:
    """One NIXL agent with one UCX backend, pushing KV blocks to peers by WRITE.

    Single-thread-owned: create it, use it and close it from one thread (the
    NIXL thread).  There is no progress thread: :meth:`poll` and
    :meth:`get_notifications` drive the UCX worker.
    """

    def __init__(
        self,
        name: str,
        *,
        memory: MemoryKind = MemoryKind.DRAM,
        backend_params: Mapping[str, str] | None = None,
    ) -> None:
        """Create the agent (no progress thread, no listener) and its UCX backend.

        Args:
            name: NIXL agent name; must be unique among the agents that talk.
            memory: memory kind of the local KV regions.
            backend_params: UCX backend params; default :data:`DEFAULT_UCX_PARAMS`.

        Raises:
            NixlError: NIXL missing (BACKEND_ERROR) or the backend failed.
        """
        if not name:
            raise NixlError(FailureReason.INVALID_REQUEST, "agent name must be non-empty")
        api = _nixl_api()
        self._name = name
        self._memory = memory
        self._token = object()
        self._next_handle_id = 1
        self._local: _Layout | None = None
        self._reg: Any = None
        self._peers: dict[str, _Peer] = {}
        self._live: dict[int, WriteHandle] = {}
        params = dict(DEFAULT_UCX_PARAMS if backend_params is None else backend_params)
        try:
            config = api.nixl_agent_config(enable_prog_thread=False, backends=[])
            agent = api.nixl_agent(name, config)
            agent.create_backend("UCX", params)
        except RuntimeError as exc:  # "No plugins available for NIXL"
            raise NixlError(FailureReason.BACKEND_ERROR, f"create agent {name!r}: {exc}") from exc
        except Exception as exc:
            raise _translate(
                exc,
                f"create agent {name!r} with UCX {params}",
                {FailureReason.PEER_UNKNOWN: FailureReason.BACKEND_ERROR},
            ) from exc
        self._agent: Any = agent

    # ----------------------------------------------------------------- properties

    @property
    def name(self) -> str:
        return self._name

    @property
    def memory(self) -> MemoryKind:
        return self._memory

    @property
    def regions(self) -> tuple[KVRegion, ...]:
        return () if self._local is None else self._local.regions

    @property
    def closed(self) -> bool:
        return self._agent is None

    @property
    def peers(self) -> tuple[PeerKey, ...]:
        return tuple(p.key for p in self._peers.values())

    @property
    def live_handles(self) -> int:
        """Number of handles posted and not yet released."""
        return len(self._live)

    # ----------------------------------------------------------------- local memory

    def register_kv(self, regions: Sequence[KVRegion]) -> None:
        """Register the local KV cache regions (once per endpoint).

        Raises:
            NixlError: INVALID_REQUEST for bad/duplicate registration or regions that
                don't pair with an already-added peer; NIXL errors otherwise.
        """
        agent = self._require_agent()
        if self._local is not None:
            raise NixlError(
                FailureReason.INVALID_REQUEST, f"{self._name}: KV regions already registered"
            )
        layout = _Layout.of(regions, f"{self._name}: register_kv")
        for peer in self._peers.values():
            _check_pairing(layout, peer.layout, peer.key)
        descs = [(r.base_addr, r.nbytes, r.device_id, "") for r in layout.regions]
        try:
            self._reg = agent.register_memory(descs, self._memory.value)
        except Exception as exc:
            raise _translate(exc, f"{self._name}: register {len(descs)} regions") from exc
        self._local = layout

    def metadata(self) -> bytes:
        """This agent's metadata blob, for peers' :meth:`add_peer`."""
        agent = self._require_agent()
        try:
            return bytes(agent.get_agent_metadata())
        except Exception as exc:
            raise _translate(exc, f"{self._name}: get metadata") from exc

    # ----------------------------------------------------------------- peers

    def add_peer(
        self,
        key: PeerKey,
        metadata: bytes,
        regions: Sequence[KVRegion],
        *,
        memory: MemoryKind | None = None,
    ) -> None:
        """Load a peer's metadata and remember its KV regions (plain ints, never pickle).

        Adding the same key again is a no-op (if the regions are the same).  A new
        incarnation of a known agent name replaces the old one: its live handles
        are released and its metadata removed first.

        Args:
            key: the peer's agent name and incarnation.
            metadata: the peer's :meth:`metadata` blob (untrusted input).
            regions: the peer's KV regions, paired by index with ours.
            memory: the peer's memory kind; defaults to ours.

        Raises:
            NixlError: INVALID_REQUEST (layout), METADATA_MISMATCH (bad blob, or a
                blob of another agent), or other NIXL failures.
        """
        agent = self._require_agent()
        layout = _Layout.of(regions, f"peer {key.agent_name!r}")
        if self._local is not None:
            _check_pairing(self._local, layout, key)
        existing = self._peers.get(key.agent_name)
        if existing is not None:
            if existing.key == key:
                if existing.layout.regions != layout.regions:
                    raise NixlError(
                        FailureReason.INVALID_REQUEST,
                        f"peer {key} already added with different regions; "
                        "a changed layout needs a new incarnation",
                    )
                return
            _log.info("replacing peer %s with incarnation %s", existing.key, key.incarnation)
            self._forget_peer(existing, FailureReason.PEER_DISCONNECTED)
        try:
            loaded = agent.add_remote_agent(metadata)
        except Exception as exc:
            raise _translate(exc, f"{self._name}: add peer {key}") from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != key.agent_name:
            stale = self._peers.get(loaded_name)
            if stale is not None:  # its metadata was just overwritten; don't trust it
                self._forget_peer(stale, FailureReason.PEER_DISCONNECTED)
            else:
                self._invalidate(loaded_name)
            raise NixlError(
                FailureReason.METADATA_MISMATCH,
                f"metadata given for peer {key.agent_name!r} belongs to agent {loaded_name!r}",
            )
        mem = (memory or self._memory).value
        self._peers[key.agent_name] = _Peer(key=key, layout=layout, mem_type=mem)

    def remove_peer(self, key: PeerKey) -> None:
        """Forget a peer (idempotent); its live handles are released first.

        A key whose incarnation is not the current one for that agent name is a no-op.
        """
        self._require_agent()
        peer = self._peers.get(key.agent_name)
        if peer is not None and peer.key == key:
            self._forget_peer(peer, FailureReason.CANCELLED)

    def has_peer(self, key: PeerKey) -> bool:
        peer = self._peers.get(key.agent_name)
        return peer is not None and peer.key == key

    # ----------------------------------------------------------------- transfers

    def post_write(
        self,
        peer: PeerKey,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        notif: bytes = b"",
    ) -> WriteHandle:
        """WRITE local block ``local_blocks[i]`` to the peer's ``remote_blocks[i]``, all regions.

        Runs that are consecutive on both sides become one descriptor per region.
        ``notif`` (if non-empty) reaches the peer once the data has landed.  With
        zero blocks nothing is transferred; the notification (if any) is sent with
        :meth:`send_notif` instead, so the receiver still sees it, and the returned
        handle is already DONE.

        Raises:
            NixlError: INVALID_REQUEST (lengths, range, duplicate destination, no
                local registration) before anything is posted; PEER_UNKNOWN;
                PEER_DISCONNECTED and other NIXL failures when posting.
        """
        posted_at = time.monotonic()
        agent = self._require_agent()
        target = self._require_peer(peer)
        local = self._local
        if local is None:
            raise NixlError(FailureReason.INVALID_REQUEST, "register_kv() before post_write()")
        plan = _plan_write(
            local, target.layout, local_blocks, remote_blocks, f"peer {peer.agent_name!r}"
        )
        if plan.num_descriptors == 0:
            if notif:
                self.send_notif(peer, notif)
            return self._new_handle(
                peer,
                num_blocks=0,
                nbytes=0,
                num_descriptors=0,
                notif=notif,
                posted_at=posted_at,
                state=TransferState.DONE,
                xfer=None,
            )
        try:
            local_descs = agent.get_xfer_descs(plan.local_rows, self._memory.value)
            remote_descs = agent.get_xfer_descs(plan.remote_rows, target.mem_type)
        except Exception as exc:
            raise _translate(exc, self._write_ctx(peer, plan)) from exc
        if local_descs is None or remote_descs is None:  # NIXL logs and returns None
            raise NixlError(
                FailureReason.INVALID_REQUEST, f"{self._write_ctx(peer, plan)}: bad descriptors"
            )
        try:
            xfer = agent.initialize_xfer("WRITE", local_descs, remote_descs, peer.agent_name, notif)
        except Exception as exc:
            raise _translate(exc, self._write_ctx(peer, plan)) from exc
        try:
            status = agent.transfer(xfer)
        except Exception as exc:
            err = _translate(exc, self._write_ctx(peer, plan))
            self._release_quietly(xfer)
            raise err from exc
        state = _STATE_BY_STATUS.get(status, TransferState.FAILED)
        if state is TransferState.FAILED:
            self._release_quietly(xfer)
            raise NixlError(
                FailureReason.TRANSFER_ERROR,
                f"{self._write_ctx(peer, plan)}: transfer() -> {status}",
            )
        return self._new_handle(
            peer,
            num_blocks=len(local_blocks),
            nbytes=plan.nbytes,
            num_descriptors=plan.num_descriptors,
            notif=notif,
            posted_at=posted_at,
            state=state,
            xfer=xfer,
        )

    def poll(self, handle: WriteHandle) -> TransferState:
        """Progress the worker and return the handle's state.

        DONE and FAILED are terminal and cached; ``handle.failure`` says why a
        handle FAILED.  ``"ERR"`` from NIXL gives FAILED (TRANSFER_ERROR); a NIXL
        exception marks the handle FAILED and is raised as :class:`NixlError`
        (later polls return FAILED).  A handle released while in progress (by
        :meth:`release`, :meth:`remove_peer` or a peer's new incarnation) is FAILED
        with CANCELLED / PEER_DISCONNECTED.

        Raises:
            NixlError: the transfer failed (e.g. PEER_DISCONNECTED), or the handle
                belongs to another endpoint (INVALID_REQUEST).
        """
        self._check_owner(handle)
        if handle.state is not TransferState.IN_PROGRESS:
            return handle.state
        agent = self._require_agent()
        try:
            status = agent.check_xfer_state(handle._xfer)
        except Exception as exc:
            err = _translate(exc, f"{self._name}: poll WRITE to {handle.peer}")
            handle.state = TransferState.FAILED
            handle.failure = err.reason
            raise err from exc
        state = _STATE_BY_STATUS.get(status, TransferState.FAILED)
        handle.state = state
        if state is TransferState.DONE:
            handle.completed_at = time.monotonic()
        elif state is TransferState.FAILED:
            handle.failure = FailureReason.TRANSFER_ERROR
        return state

    def release(self, handle: WriteHandle) -> None:
        """Free the NIXL request (idempotent).

        Releasing an IN_PROGRESS handle asks NIXL to cancel it; if that works the
        handle becomes FAILED/CANCELLED, if not NixlError is raised and the handle
        stays live (release again after it completes).
        """
        self._check_owner(handle)
        if handle.released:
            return
        if handle._xfer is not None:
            try:
                handle._xfer.release()
            except Exception as exc:
                raise _translate(exc, f"{self._name}: release handle {handle.handle_id}") from exc
        self._mark_released(handle, FailureReason.CANCELLED)

    # ----------------------------------------------------------------- notifications

    def send_notif(self, peer: PeerKey, msg: bytes) -> None:
        """Send a standalone notification (not tied to a transfer).  b"" is delivered too."""
        agent = self._require_agent()
        self._require_peer(peer)
        try:
            agent.send_notif(peer.agent_name, msg)
        except Exception as exc:
            raise _translate(exc, f"{self._name}: notify {peer}") from exc

    def get_notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as (sender agent name, message), per sender in arrival order."""
        agent = self._require_agent()
        try:
            raw: Mapping[Any, Sequence[Any]] = agent.get_new_notifs()
        except Exception as exc:
            raise _translate(exc, f"{self._name}: get notifications") from exc
        out: list[tuple[str, bytes]] = []
        for sender, messages in raw.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((name, bytes(m)) for m in messages)
        return out

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Release all handles, remove peers, deregister memory, drop the agent (idempotent).

        Best effort: failures are logged, not raised.
        """
        agent = self._agent
        if agent is None:
            return
        for peer in list(self._peers.values()):
            self._forget_peer(peer, FailureReason.CANCELLED)
        for handle in list(self._live.values()):
            self._release_quietly(handle._xfer)
            self._mark_released(handle, FailureReason.CANCELLED)
        if self._reg is not None:
            try:
                agent.deregister_memory(self._reg)
            except Exception as exc:
                if not _is_nixl_exception(exc):
                    raise
                _log.warning("%s: deregister_memory failed: %s", self._name, exc)
            self._reg = None
        self._local = None
        self._agent = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._peers)} peers"
        return f"NixlEndpoint({self._name!r}, {self._memory.name}, {state})"

    # ----------------------------------------------------------------- internals

    def _write_ctx(self, peer: PeerKey, plan: _Plan) -> str:
        return f"{self._name}: WRITE {plan.nbytes} B ({plan.num_descriptors} descriptors) to {peer}"

    def _require_agent(self) -> Any:
        if self._agent is None:
            raise NixlError(FailureReason.INVALID_REQUEST, f"endpoint {self._name!r} is closed")
        return self._agent

    def _require_peer(self, key: PeerKey) -> _Peer:
        peer = self._peers.get(key.agent_name)
        if peer is None or peer.key != key:
            known = None if peer is None else peer.key.incarnation
            raise NixlError(
                FailureReason.PEER_UNKNOWN,
                f"{self._name}: unknown peer {key} (known incarnation: {known})",
            )
        return peer

    def _check_owner(self, handle: WriteHandle) -> None:
        if handle._owner is not self._token:
            raise NixlError(
                FailureReason.INVALID_REQUEST,
                f"handle {handle.handle_id} does not belong to endpoint {self._name!r}",
            )

    def _new_handle(
        self,
        peer: PeerKey,
        *,
        num_blocks: int,
        nbytes: int,
        num_descriptors: int,
        notif: bytes,
        posted_at: float,
        state: TransferState,
        xfer: Any,
    ) -> WriteHandle:
        handle = WriteHandle(
            handle_id=self._next_handle_id,
            peer=peer,
            num_blocks=num_blocks,
            nbytes=nbytes,
            num_descriptors=num_descriptors,
            notif=notif,
            posted_at=posted_at,
            state=state,
            _xfer=xfer,
            _owner=self._token,
        )
        self._next_handle_id += 1
        if state is TransferState.DONE:
            handle.completed_at = time.monotonic()
        self._live[handle.handle_id] = handle
        return handle

    def _mark_released(self, handle: WriteHandle, reason_if_active: FailureReason) -> None:
        if handle.state is TransferState.IN_PROGRESS:
            handle.state = TransferState.FAILED
            handle.failure = reason_if_active
        handle.released = True
        handle._xfer = None
        self._live.pop(handle.handle_id, None)

    def _release_quietly(self, xfer: Any) -> None:
        if xfer is None:
            return
        try:
            xfer.release()
        except Exception as exc:
            if not _is_nixl_exception(exc):
                raise
            _log.warning("%s: releasing a transfer handle failed: %s", self._name, exc)

    def _handles_to(self, name: str) -> Iterator[WriteHandle]:
        return (h for h in list(self._live.values()) if h.peer.agent_name == name)

    def _forget_peer(self, peer: _Peer, reason_if_active: FailureReason) -> None:
        for handle in self._handles_to(peer.key.agent_name):
            self._release_quietly(handle._xfer)
            self._mark_released(handle, reason_if_active)
        self._invalidate(peer.key.agent_name)
        self._peers.pop(peer.key.agent_name, None)

    def _invalidate(self, agent_name: str) -> None:
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as exc:
            if not _is_nixl_exception(exc):
                raise
            _log.warning("%s: remove_remote_agent(%r) failed: %s", self._name, agent_name, exc)
