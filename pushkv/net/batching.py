"""Batches drained from a queue, bounded by count and by bytes (NodeStream).

A node relay and the coordinator each send what queued up for several
channels as one message. `Batcher.next` waits for the first item only, then
takes what is already queued, never waiting for more, up to `max_items` and
`max_bytes` (an item that would pass the byte bound starts the next batch: a
batch exceeds it only when its one item does). So a batch never grows past
the gRPC message limit that the same items sent one by one would respect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    def ByteSize(self) -> int: ...


T = TypeVar("T", bound=Sized)

# What one NodeUp or NodeDown carries at most (gRPC's default limit is 4 MiB).
MAX_BATCH_ITEMS = 1024
MAX_BATCH_BYTES = 1 << 20


class Batcher(Generic[T]):
    """Takes batches from `queue`; a None in the queue ends it."""

    def __init__(
        self,
        queue: asyncio.Queue[T | None],
        *,
        max_items: int = MAX_BATCH_ITEMS,
        max_bytes: int = MAX_BATCH_BYTES,
        size: Callable[[T], int] | None = None,
    ) -> None:
        self._q = queue
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._size = size or (lambda m: m.ByteSize())
        self._carry: T | None = None  # taken, but over the last batch's bound
        self._ended = False

    async def next(self) -> list[T] | None:
        """The next batch; None once the queue ended (after its last batch)."""
        if self._ended:
            return None
        first = self._carry if self._carry is not None else await self._q.get()
        self._carry = None
        if first is None:
            self._ended = True
            return None
        batch = [first]
        size = self._size(first)
        q = self._q
        while len(batch) < self._max_items and not q.empty():
            item = q.get_nowait()
            if item is None:
                self._ended = True
                break
            n = self._size(item)
            if size + n > self._max_bytes:
                self._carry = item
                break
            batch.append(item)
            size += n
        return batch
