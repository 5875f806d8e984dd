"""Typed adapter over NIXL: with :mod:`pushkv.agent.nixl_boundary` (the import and the
translation of what NIXL raises) and :mod:`pushkv.agent.prepped` (the block lists it
prepares once), the only module in pushkv that uses ``nixl``.

Everything NIXL hands back as strings ("DONE"/"PROC"/"ERR"), bytes-or-str names
and untyped binding exceptions is converted here, once, into
:class:`~agent.nixl_types.TransferState`, :class:`~agent.nixl_types.FailureReason`
and :class:`~agent.nixl_types.NixlError`.  Whole blocks and head slices go by
index into prepared lists (:mod:`pushkv.agent.prepped`); token ranges and a pipeline
stage's regions are planned by :mod:`pushkv.agent.write_plan` (pure, no nixl).

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
(:class:`~agent.nixl_types.KVRegion`); NIXL's pickle-based
``get_serialized_descs`` / ``deserialize_descs`` are never used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Self

from pushkv.agent.nixl_boundary import STATE_BY_STATUS as _STATE_BY_STATUS
from pushkv.agent.nixl_boundary import logged_if_nixl_fails as _logged_if_nixl_fails
from pushkv.agent.nixl_boundary import nixl_api as _nixl_api
from pushkv.agent.nixl_boundary import quiet_nixl_env
from pushkv.agent.nixl_boundary import text as _text
from pushkv.agent.nixl_boundary import translate as _translate
from pushkv.agent.nixl_types import (
    BlockResize,
    BlockSlice,
    FailureReason,
    KVRegion,
    MemoryKind,
    NixlError,
    PeerKey,
    TransferState,
    WriteHandle,
)
from pushkv.agent.prepped import LOCAL, BlockTables, PreppedWrite
from pushkv.agent.write_plan import (
    Layout,
    WritePlan,
    check_pairing,
    plan_resized_write,
    plan_sliced_write,
    plan_write,
)

__all__ = ["DEFAULT_UCX_PARAMS", "NixlEndpoint", "quiet_nixl_env"]

_log = logging.getLogger("pushkv.agent.nixl")

#: UCX backend parameters used unless the caller overrides them.  Error mode
#: "none" lets a WRITE carrying a notification complete on the initiator's
#: progress alone (in "peer" mode it waits for the target to progress) and cuts
#: small-message latency ~10x.  Peer death is still reported as
#: NIXL_ERR_REMOTE_DISCONNECT.  Both sides must use the same mode.
DEFAULT_UCX_PARAMS: Final[Mapping[str, str]] = {"ucx_error_handling_mode": "none"}


@dataclass(frozen=True, slots=True)
class _Peer:
    key: PeerKey
    layout: Layout
    mem_type: str
    tables: BlockTables  # its prepared block lists (agent/prepped.py), released with it
    # Sub-layouts of `layout` (its regions in the given order), built once per
    # region list: pipeline-parallel prefill writes into the decode regions of
    # its stage's layers only.
    picks: dict[tuple[int, ...], Layout] = field(default_factory=dict)

    def pick(self, regions: tuple[int, ...], what: str) -> Layout:
        """The layout of these regions of the peer's, in this order."""
        got = self.picks.get(regions)
        if got is None:
            got = self.picks[regions] = self.layout.pick(regions, what)
        return got


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
        self._local: Layout | None = None
        self._tables: BlockTables | None = None  # ours, prepared on first use
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
        layout = Layout.of(regions, f"{self._name}: register_kv")
        for peer in self._peers.values():
            check_pairing(layout, peer.layout, peer.key)
        descs = [(r.base_addr, r.nbytes, r.device_id, "") for r in layout.regions]
        try:
            self._reg = agent.register_memory(descs, self._memory.value)
        except Exception as exc:
            raise _translate(exc, f"{self._name}: register {len(descs)} regions") from exc
        self._local = layout
        self._tables = BlockTables(agent, LOCAL, layout, self._memory.value)

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
        layout = Layout.of(regions, f"peer {key.agent_name!r}")
        if self._local is not None and len(self._local.regions) >= len(layout.regions):
            # (A pipeline-parallel stage holds fewer regions than its decode
            # peer: each WRITE names the peer's regions it pairs with.)
            check_pairing(self._local, layout, key)
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
        loaded_name = _text(loaded)
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
        tables = BlockTables(agent, key.agent_name, layout, mem)
        self._peers[key.agent_name] = _Peer(key=key, layout=layout, mem_type=mem, tables=tables)

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
        *,
        block_slice: BlockSlice | None = None,
        resize: BlockResize | None = None,
        dst_regions: Sequence[int] = (),
    ) -> WriteHandle:
        """WRITE local block ``local_blocks[i]`` to the peer's ``remote_blocks[i]``, all regions.

        Runs that are consecutive on both sides become one descriptor per region.
        With ``block_slice`` (engines of different TP sizes) only that head range
        of the larger side's blocks moves, one descriptor per block and region.
        With ``resize`` (engines of different block sizes) a token range moves
        between blocks of different sizes (:func:`plan_resized_write`).
        With ``dst_regions`` (a pipeline-parallel prefill stage) local region
        ``i`` goes into the peer's region ``dst_regions[i]``, not region ``i``.
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
        side = f"peer {peer.agent_name!r}"
        xfer: Any = None
        state = TransferState.DONE
        if resize is None and not dst_regions:  # whole blocks or head slices: prepared lists
            w = PreppedWrite(local, target.layout, local_blocks, remote_blocks, side, block_slice)
            nbytes, num_descriptors = w.nbytes, w.num_descriptors
            if num_descriptors:
                xfer, state = self._post_prepped(agent, target, w, notif)
        else:
            remote = target.pick(tuple(dst_regions), side) if dst_regions else target.layout
            if dst_regions:
                check_pairing(local, remote, peer)
            if resize is not None:
                plan = plan_resized_write(local, remote, local_blocks, remote_blocks, side, resize)
            elif block_slice is None:
                plan = plan_write(local, remote, local_blocks, remote_blocks, side)
            else:
                plan = plan_sliced_write(
                    local, remote, local_blocks, remote_blocks, side, block_slice
                )
            nbytes, num_descriptors = plan.nbytes, plan.num_descriptors
            if num_descriptors:
                xfer, state = self._post(agent, target, plan, notif)
        if not num_descriptors and notif:  # zero blocks: nothing to WRITE, the notification goes
            self.send_notif(peer, notif)
        handle = WriteHandle(
            handle_id=self._next_handle_id,
            peer=peer,
            num_blocks=len(local_blocks),
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
            out.extend((_text(sender), bytes(m)) for m in messages)
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
            self._drop(handle, FailureReason.CANCELLED)
        if self._tables is not None:  # the lists name the registered memory: before it goes
            self._tables.release()
            self._tables = None
        if self._reg is not None:
            with _logged_if_nixl_fails(f"{self._name}: deregister_memory"):
                agent.deregister_memory(self._reg)
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

    def _write_ctx(self, peer: PeerKey, plan: WritePlan | PreppedWrite) -> str:
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

    def _post(
        self, agent: Any, target: _Peer, plan: WritePlan, notif: bytes
    ) -> tuple[Any, TransferState]:
        """Hand ``plan`` to NIXL; returns the live request and its first state (not FAILED)."""
        peer = target.key
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
        return self._start(agent, xfer, peer, plan)

    def _post_prepped(
        self, agent: Any, target: _Peer, w: PreppedWrite, notif: bytes
    ) -> tuple[Any, TransferState]:
        """``w`` by index into the prepared lists (agent/prepped.py); as :meth:`_post`."""
        ours, theirs = self._tables, target.tables
        assert ours is not None  # set with the registration post_write checked
        mine, peers = ours.get(*w.local_key), theirs.get(*w.remote_key)
        try:
            xfer = agent.make_prepped_xfer(
                "WRITE",
                mine,
                ours.indices(w.local_blocks),
                peers,
                theirs.indices(w.remote_blocks),
                notif,
            )
        except Exception as exc:
            raise _translate(exc, self._write_ctx(target.key, w)) from exc
        return self._start(agent, xfer, target.key, w)

    def _start(
        self, agent: Any, xfer: Any, peer: PeerKey, plan: WritePlan | PreppedWrite
    ) -> tuple[Any, TransferState]:
        """Post a made request; its first state (not FAILED), or raise having released it."""
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
        return xfer, state

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
        with _logged_if_nixl_fails(f"{self._name}: releasing a transfer handle"):
            xfer.release()

    def _drop(self, handle: WriteHandle, reason_if_active: FailureReason) -> None:
        """Release ``handle`` whatever its state; NIXL failures are only logged."""
        self._release_quietly(handle._xfer)
        self._mark_released(handle, reason_if_active)

    def _forget_peer(self, peer: _Peer, reason_if_active: FailureReason) -> None:
        name = peer.key.agent_name
        for handle in [h for h in self._live.values() if h.peer.agent_name == name]:
            self._drop(handle, reason_if_active)
        peer.tables.release()  # before NIXL forgets the peer the lists name
        self._invalidate(name)
        self._peers.pop(name, None)

    def _invalidate(self, agent_name: str) -> None:
        with _logged_if_nixl_fails(f"{self._name}: remove_remote_agent({agent_name!r})"):
            self._agent.remove_remote_agent(agent_name)
