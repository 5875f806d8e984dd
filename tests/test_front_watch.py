"""WatchTransfers through the front (controlplane/front_watch.py and
partition_watch.py): real partition processes on real Unix sockets, the
front in the test's loop, and the test as the watching client."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncGenerator

import pytest

from pushkv.bench.coordinator_workload import DECODE, PREFILL, decode_request
from pushkv.controlplane.errors import InvalidArgument, Unavailable
from pushkv.controlplane.front import PartitionFront
from pushkv.controlplane.partition_link import PartitionProcess
from pushkv.v1 import partition_pb2 as ppb
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.core_shapes import ids_in_partition
from tests.test_front import DEADLINE_S, D, K, Node, P, hello, with_front, with_partitions


def begin(t: str) -> ppb.PartitionCall:
    return ppb.PartitionCall(
        begin=pb.BeginTransferRequest(
            transfer_id=t, prefill_engine_id=PREFILL, decode_engine_id=DECODE
        )
    )


async def take(
    events: AsyncGenerator[pb.TransferEvent, None], n: int
) -> list[tuple[str, pb.TransferState.ValueType]]:
    """The next `n` events' transfer ids and states, within the deadline."""

    async def read() -> list[tuple[str, pb.TransferState.ValueType]]:
        return [
            ((e := await anext(events)).transfer.transfer_id, e.transfer.state) for _ in range(n)
        ]

    return await asyncio.wait_for(read(), DEADLINE_S)


def test_a_watch_replays_every_partition_oldest_first_then_tells_each_change() -> None:
    """include_existing: the transfers of both partitions, merged oldest
    first, as the RPC's own replay; then the changes in either partition as
    they happen; a state filter applies at each partition; the client's
    leaving closes the watch at the front."""
    (a0, a1), (b0, b1) = ids_in_partition(0, 2, K, "w"), ids_in_partition(1, 2, K, "w")

    async def body(front: PartitionFront) -> None:
        node = Node(front).start()
        node.send(hello(P), hello(D))
        await node.until("both welcomed", lambda: "welcome" in node.kinds(D))
        for t in (a0, b0, a1, b1):  # created in this order, across both partitions
            await front.transfer_call(begin(t), t)
        awaiting = pb.TRANSFER_STATE_AWAITING
        events = front.watch(pb.WatchTransfersRequest(include_existing=True))
        armed_only = front.watch(
            pb.WatchTransfersRequest(states=[pb.TRANSFER_STATE_ARMED], include_existing=True)
        )
        async with contextlib.aclosing(events), contextlib.aclosing(armed_only):
            assert await take(events, 4) == [(t, awaiting) for t in (a0, b0, a1, b1)]
            for t in (b1, a0):  # a change in each partition
                await front.transfer_call(ppb.PartitionCall(register=decode_request(t)), t)
            armed = pb.TRANSFER_STATE_ARMED
            assert await take(events, 2) == [(b1, armed), (a0, armed)]
            # Opened at its first read, after the changes: its replay, oldest first.
            assert await take(armed_only, 2) == [(a0, armed), (b1, armed)]
            assert len(front.watches._watches) == 2
        assert front.watches._watches == {}  # the client went: both closed
        late = front.watch(pb.WatchTransfersRequest(include_existing=True))
        async with contextlib.aclosing(late):  # a watch opened after them still works
            got = dict(await take(late, 4))
            assert got == {a0: armed, b0: awaiting, a1: awaiting, b1: armed}
        await node.end()

    with_front(body)


def test_a_refused_filter_ends_the_watch_with_its_code() -> None:
    async def body(front: PartitionFront) -> None:
        events = front.watch(pb.WatchTransfersRequest(states=[99]))  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="unknown state 99"):
            await asyncio.wait_for(anext(events), DEADLINE_S)
        assert front.watches._watches == {}

    with_front(body)


def test_a_partition_that_dies_ends_every_watch_unavailable() -> None:
    async def body(front: PartitionFront, parts: list[PartitionProcess]) -> None:
        events = front.watch(pb.WatchTransfersRequest())
        async with contextlib.aclosing(events):
            reading = asyncio.ensure_future(anext(events))
            parts[1].proc.send_signal(signal.SIGKILL)
            with pytest.raises(Unavailable, match="partition 1's connection ended"):
                await asyncio.wait_for(reading, DEADLINE_S)
        with pytest.raises(Unavailable):  # and no watch opens after that
            await anext(front.watch(pb.WatchTransfersRequest()))

    with_partitions(body, exits_clean=False)
