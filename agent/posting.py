"""The prefill agent's WRITEs on its NIXL endpoint: the decode peers it knows,
posting one WRITE per target, and polling and releasing the handles. Used only
by the NIXL thread (agent/dataplane.py), the endpoint's one owner."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pushkv.agent.messages import FencedMsg, OrderMsg, PeerMsg, Target
from pushkv.agent.nixl_adapter import NixlEndpoint
from pushkv.agent.nixl_types import (
    BlockSlice,
    FailureReason,
    NixlError,
    PeerKey,
    TransferState,
    WriteHandle,
)
from pushkv.agent.notif import WriteNotif
from pushkv.rules.block_groups import BlockGroups, flat

log = logging.getLogger("pushkv.agent")

# (target, prefill blocks, decode blocks) of one WRITE, per KV group
Write = tuple[Target, BlockGroups, BlockGroups]


@dataclass(slots=True)
class InFlight:
    """An order's posted WRITEs, until they settle."""

    order: OrderMsg
    handles: list[WriteHandle]
    # Notifications to send once every handle is DONE (progressive push: the
    # last chunk went before the earlier ones were done).
    notify: tuple[tuple[PeerKey, bytes], ...] = ()
    replaced: int = 0  # posts released before these (a preempted chunked prefill)


class Poster:
    def __init__(self, ep: NixlEndpoint) -> None:
        self.ep = ep
        self._peers: dict[tuple[str, int], PeerKey] = {}
        self.writes_posted = 0

    # ------------------------------------------------------------ peers
    def add_peer(self, msg: PeerMsg) -> None:
        key = PeerKey(msg.agent_name, msg.incarnation)
        try:
            self.ep.add_peer(key, msg.metadata, msg.regions, memory=msg.memory)
        except NixlError as exc:
            log.warning("cannot load peer %s/%s: %s", msg.engine_id, msg.rank, exc)
            return
        self._peers[(msg.engine_id, msg.rank)] = key

    def fence(self, msg: FencedMsg) -> None:
        key = self._peers.get((msg.engine_id, msg.rank))
        if key is not None and key.incarnation == msg.incarnation:
            del self._peers[(msg.engine_id, msg.rank)]
            self.ep.remove_peer(key)

    def peer(self, tgt: Target) -> PeerKey:
        peer = self._peers.get((tgt.decode_engine_id, tgt.decode_rank))
        if peer is None or peer.incarnation != tgt.decode_incarnation:
            raise NixlError(
                FailureReason.PEER_UNKNOWN,
                f"decode peer {tgt.decode_engine_id}/{tgt.decode_rank}"
                f"@{tgt.decode_incarnation} is unknown or fenced",
            )
        return peer

    # ------------------------------------------------------------ WRITEs
    @staticmethod
    def notif(order: OrderMsg, tgt: Target) -> bytes:
        return WriteNotif(order.transfer_id, order.prefill_rank, tgt.expected_writers).encode()

    def post(self, order: OrderMsg, writes: list[Write], notify: bool = True) -> list[WriteHandle]:
        """One WRITE per (target, src, dst), each with its notification unless
        `notify` is False; on a failure the ones posted are released and the
        NixlError raised. The WRITE pairs src's and dst's ids position by
        position, group after group (`flat`: every group's block b lies in
        every KV region)."""
        handles: list[WriteHandle] = []
        try:
            for tgt, src, dst in writes:
                cut = BlockSlice(tgt.slice_offset, tgt.slice_len) if tgt.slice_len else None
                handles.append(
                    self.ep.post_write(
                        self.peer(tgt),
                        flat(src),
                        flat(dst),
                        self.notif(order, tgt) if notify else b"",
                        block_slice=cut,
                        resize=tgt.resize,
                        dst_regions=tgt.dst_regions,
                    )
                )
                self.writes_posted += 1
        except NixlError:
            self.release(handles)
            raise
        return handles

    def settle(self, handles: list[WriteHandle]) -> tuple[bool, str]:
        """(any still in progress, why the first that failed did, or "")."""
        pending, failure = False, ""
        for h in handles:
            try:
                state = self.ep.poll(h)
            except NixlError as exc:
                failure = failure or str(exc)
                continue
            if state is TransferState.FAILED:
                failure = failure or f"WRITE failed ({h.failure.value if h.failure else 'error'})"
            elif state is TransferState.IN_PROGRESS:
                pending = True
        return pending, failure

    def all_done(self, handles: list[WriteHandle]) -> bool:
        pending, failure = self.settle(handles)
        return not pending and not failure

    def send_notifs(self, notify: tuple[tuple[PeerKey, bytes], ...]) -> None:
        for peer, msg in notify:
            self.ep.send_notif(peer, msg)

    def outcome(self, f: InFlight) -> tuple[str, int, int, int] | None:
        """None while `f`'s WRITEs are pending; else (its failure or "", bytes,
        descriptors, posts), its handles released and, when all are DONE, its
        notifications sent (after every chunk is DONE)."""
        pending, failure = self.settle(f.handles)
        if pending and not failure:
            return None
        if not failure and f.notify:
            try:
                self.send_notifs(f.notify)
            except NixlError as exc:
                failure = str(exc)
        nbytes, descs, n = self.release(f.handles)
        return failure, nbytes, descs, n + f.replaced

    def release(self, handles: list[WriteHandle]) -> tuple[int, int, int]:
        """Release the handles; (bytes, descriptors, posts) they moved."""
        for h in handles:
            try:
                self.ep.release(h)
            except NixlError as exc:
                log.warning("release of WRITE handle failed: %s", exc)
        nbytes = sum(h.nbytes for h in handles)
        return nbytes, sum(h.num_descriptors for h in handles), len(handles)
