"""The agent's live transfers, re-sent in every hello so that a newer leader
of the same cluster adopts them after a failover (pushkv.proto,
AgentHello.held; docs/reliability.md, "Failover rebuild").

The NIXL thread owns the state it is built from: it publishes an immutable
snapshot when asked (`SnapshotMsg`, queued behind everything the link sent it
before, so behind the loss that stopped its posting); the link thread waits for
that snapshot, under a deadline, before it says hello.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pushkv.agent.messages import OrderMsg


@dataclass(frozen=True, slots=True)
class HeldItem:
    """One live transfer. Prefill: the orders posted (never ordered again) and
    held unposted (refused once a newer leader welcomes the agent). Decode:
    the prefill ranks whose notification this rank counted, and `ready` if it
    counted them all and told its worker KV_READY (lately: agent/arrivals.py)."""

    transfer_id: str
    posted: tuple[str, ...] = ()
    unposted: tuple[str, ...] = ()
    counted: tuple[int, ...] = ()
    ready: bool = False


class SnapshotBox:
    """Published by the NIXL thread, read by the link thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._gen = 0
        self._items: tuple[HeldItem, ...] = ()

    def publish(self, gen: int, items: tuple[HeldItem, ...]) -> None:
        with self._cond:
            if gen > self._gen:
                self._gen, self._items = gen, items
                self._cond.notify_all()

    def wait(self, gen: int, timeout: float) -> tuple[HeldItem, ...] | None:
        """The snapshot of generation `gen` or later; None if none came in time."""
        with self._cond:
            if self._cond.wait_for(lambda: self._gen >= gen, timeout):
                return self._items
            return None


def prefill_items(
    held: Iterable[str], posted: Sequence[OrderMsg], unposted: Sequence[OrderMsg]
) -> tuple[HeldItem, ...]:
    """A prefill agent's live transfers: those whose blocks the host holds
    (`held`) or that have orders here, with the orders posted (in flight, or
    chunks of a partial one) and held unposted (queued or armed)."""
    by_posted: dict[str, list[str]] = {}
    by_unposted: dict[str, list[str]] = {}
    for order in posted:
        by_posted.setdefault(order.transfer_id, []).append(order.order_id)
    for order in unposted:
        by_unposted.setdefault(order.transfer_id, []).append(order.order_id)
    tids = sorted(set(held) | by_posted.keys() | by_unposted.keys())
    return tuple(
        [HeldItem(t, tuple(by_posted.get(t, ())), tuple(by_unposted.get(t, ()))) for t in tids]
    )


def decode_items(
    counted: Iterable[tuple[str, tuple[int, ...]]], ready: Iterable[tuple[str, tuple[int, ...]]]
) -> tuple[HeldItem, ...]:
    """A decode agent's: the transfers expected and not told yet, with the
    prefill ranks counted, and those told KV_READY lately (`ready`)."""
    return tuple(
        [HeldItem(tid, counted=ranks) for tid, ranks in counted]
        + [HeldItem(tid, counted=ranks, ready=True) for tid, ranks in ready]
    )
