"""Orders against the gRPC message limit (controlplane/order_size.py): an
order too large to send fails its transfer (REASON_TOO_LARGE) instead of
ending its agent's stream at every replay, and a backlog of large orders goes
down in batches of about 1 MiB, never one message over the limit.

The bound in the core, property-tested against the real encoding; the rule in
the core with a fake clock; both ends on a real coordinator with simulated
agents (tests/support/sim_agent.py) whose streams keep gRPC's 4 MiB limit."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushkv.controlplane import convert
from pushkv.controlplane.clock import FakeClock
from pushkv.controlplane.domain import (
    EngineId,
    KVLayout,
    KVRegion,
    Order,
    OrderId,
    Reason,
    Role,
    State,
    TransferId,
)
from pushkv.controlplane.domain import WriteTarget as Target
from pushkv.controlplane.errors import InvalidArgument
from pushkv.controlplane.node_stream import split_batch
from pushkv.controlplane.order_size import OrderTooLarge, check, max_order_bytes, order_bytes
from pushkv.controlplane.rendezvous import Rendezvous
from pushkv.controlplane.server import Coordinator, ServerSettings, start
from pushkv.controlplane.settings import CoreSettings
from pushkv.rules.block_groups import of
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import TOKENS_PER_BLOCK, SimAgent, blocks, layout
from tests.test_rendezvous import D, P, orders, reg

# --------------------------------------------------------------- the bound

ids = st.lists(st.integers(0, 2**32 - 1), max_size=40)
groups = st.lists(ids, max_size=3).map(lambda gs: tuple(tuple(g) for g in gs))
text = st.text(max_size=40)
u32 = st.integers(0, 2**32 - 1)
targets = st.builds(
    Target,
    text,
    u32,
    text,
    groups,
    groups,
    u32,
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    u32,
    u32,
    u32,
    u32,
    u32,
    st.lists(u32, max_size=8).map(tuple),
    st.lists(u32, max_size=8).map(tuple),
)


@settings(max_examples=300, deadline=None)
@given(
    st.builds(
        Order,
        text,
        text,
        text,
        u32,
        text,
        st.lists(targets, max_size=4).map(tuple),
        st.floats(0, 4e9),
        u32,
        st.booleans(),
    ),
    st.integers(0, 2**62),
)
def test_the_bound_is_never_below_the_encoded_order(o: Order, term: int) -> None:
    msg = convert.order_message(o)
    msg.order.term = term
    exact = order_bytes(o)
    assert exact >= msg.order.ByteSize()
    assert order_bytes(o, fast=True) >= exact


def test_a_wide_order_is_named_and_the_limit_follows_the_agents() -> None:
    big = tuple(range(2**14, 2**14 + 1000))  # 3-byte ids
    tgt = Target(EngineId("d"), 0, "i", of(big), of(big), 1)
    o = Order(OrderId("o1"), TransferId("t"), EngineId("p"), 0, "i", (tgt, tgt), 0.0, 16)
    encoded = convert.order_message(o).order.ByteSize()
    assert 12_000 < encoded <= order_bytes(o) <= encoded + 600  # 2 x 2,000 ids x 3 bytes
    check([o], order_bytes(o))
    with pytest.raises(OrderTooLarge, match=r"prefill rank 0 .*\(2 targets, 4000 block ids\)"):
        check([o], order_bytes(o) - 1)
    # Agents keep gRPC's 4 MiB receive limit: a larger coordinator limit does not pass it.
    assert max_order_bytes(64 << 20) == max_order_bytes(4 << 20) < 4 << 20
    assert max_order_bytes(1 << 20) < 1 << 20


# --------------------------------------------------------------- the core

N = 300  # blocks per side: an order of about 2 x 300 x 2 bytes


def small_core(limit: int) -> Rendezvous:
    rv = Rendezvous(CoreSettings(), FakeClock(), max_order_bytes=limit)
    room = KVLayout(16, (KVRegion(0x1000, 64, 4096), KVRegion(0x100000, 64, 4096)))
    for engine, role in ((P, Role.PREFILL), (D, Role.DECODE)):
        rv.agent_hello(dataclasses.replace(reg(engine, role), layout=room))
    return rv


def sides(n: int = N) -> tuple[list[list[int]], list[list[int]], int]:
    """Prefill and decode block ids of a prompt of `n` whole blocks."""
    return [list(range(n))], [list(range(1000, 1000 + n))], n * 16


@pytest.mark.parametrize("decode_first", [True, False])
def test_an_order_over_the_limit_fails_its_transfer_and_none_is_sent(decode_first: bool) -> None:
    rv = small_core(limit=1000)
    src, dst, tokens = sides()
    if decode_first:
        rv.register_decode("t", D, dst, tokens)
        t, effects = rv.prefill_done("t", P, src, tokens)
    else:
        rv.prefill_done("t", P, src, tokens)
        t, effects = rv.register_decode("t", D, dst, tokens)
    assert t.state is State.FAILED and t.reason is Reason.TOO_LARGE
    assert "message limit" in t.detail and "600 block ids" in t.detail
    assert orders(effects) == [] and t.orders == {}
    assert "ordered" not in [s for s, _, _ in t.timeline]
    # A transfer that fits goes on as ever on the same engines.
    src, dst, tokens = sides(10)
    rv.register_decode("ok", D, dst, tokens)
    t2, effects = rv.prefill_done("ok", P, src, tokens)
    assert t2.state is State.ORDERED and len(orders(effects)) == 1


def test_an_armed_order_over_the_limit_waits_for_prefill_and_fails_then() -> None:
    rv = small_core(limit=500)  # decode's 300 ids alone pass it
    src, dst, tokens = sides()
    rv.begin("t", P, D)
    t, effects = rv.register_decode("t", D, dst, tokens)
    assert t.state is State.REGISTERED and orders(effects) == [] and t.orders == {}
    t, effects = rv.prefill_done("t", P, src, tokens)
    assert t.state is State.FAILED and t.reason is Reason.TOO_LARGE
    assert orders(effects) == []


def wide_core(groups: int, num_blocks: int) -> Rendezvous:
    rv = Rendezvous(CoreSettings(), FakeClock())
    regions = tuple(KVRegion(0x1000 + g * 2**40, 64, num_blocks, group=g) for g in range(groups))
    for engine, role in ((P, Role.PREFILL), (D, Role.DECODE)):
        rv.agent_hello(dataclasses.replace(reg(engine, role), layout=KVLayout(16, regions)))
    return rv


def test_a_side_over_the_block_bound_is_refused_and_the_largest_status_fits_4_mib() -> None:
    base = 2**28  # ids of 5 bytes, the widest
    rv = wide_core(groups=5, num_blocks=base + 2**16)
    per = 65_536  # max_blocks_per_group
    five = [list(range(base, base + per))] * 5
    with pytest.raises(InvalidArgument, match="327680 block ids in all, more than 262144"):
        rv.register_decode("t", D, five, per * 16)
    # The largest side allowed, from both engines: its status fits one message.
    four = [*five[:4], []]
    rv.register_decode("t", D, four, per * 16)
    t, _ = rv.prefill_done("t", P, four, per * 16)
    assert t.state is State.ORDERED  # equal TP: its orders fit too
    status = convert.transfer_to_pb(t, deadline_wall=0.0)
    assert 2 * 262_144 * 5 < status.ByteSize() < 4 << 20


# --------------------------------------------------------------- end to end

WIDE = 60_000  # blocks a side, ids of 3 bytes: 180 KB a side, 360 KB an order


def wide(n: int = WIDE, base: int = 2**14) -> list[list[int]]:
    return [list(range(base, base + n))]


def call(tid: str, role: str, ids: list[list[int]]) -> pb.TransferCall:
    tokens = len(ids[0]) * TOKENS_PER_BLOCK
    if role == "decode":
        return pb.TransferCall(
            register=pb.RegisterDecodeBlocksRequest(
                transfer_id=tid, decode_engine_id="d0", block_ids=blocks(*ids), num_tokens=tokens
            )
        )
    return pb.TransferCall(
        prefill_done=pb.ReportPrefillDoneRequest(
            transfer_id=tid, prefill_engine_id="p0", block_ids=blocks(*ids), num_tokens=tokens
        )
    )


async def submit(ch: grpc.aio.Channel, *calls: pb.TransferCall) -> list[pb.CallResult]:
    resp = await pbg.TransferServiceStub(ch).Submit(pb.SubmitRequest(calls=calls), timeout=10)
    assert all(r.code == 0 for r in resp.results), resp
    return list(resp.results)


async def pair(address: str) -> tuple[SimAgent, SimAgent]:
    room = layout(num_blocks=2**14 + WIDE + 8)
    p = SimAgent(address, "p0", "prefill", batching=True, kv_layout=room)
    d = SimAgent(address, "d0", "decode", batching=True, kv_layout=room)
    await p.start()
    await d.start()
    return p, d


@pytest.fixture
async def small_limit() -> AsyncIterator[Coordinator]:
    c = await start(ServerSettings(port=0, max_message_bytes=256 << 10, core=CoreSettings()))
    yield c
    await c.stop(0)


async def test_a_transfer_whose_order_passes_the_limit_fails_and_the_stream_lives(
    small_limit: Coordinator,
) -> None:
    p, d = await pair(small_limit.address)
    try:
        async with grpc.aio.insecure_channel(small_limit.address) as ch:
            # Each side fits the 256 KiB limit; the order holding both does not.
            await submit(ch, call("big", "decode", wide()))
            await submit(ch, call("big", "prefill", wide(base=2**14 + 7)))
            # The decode side learns why (a status holding both sides' ids
            # would not fit this limit either: the notice is what tells it).
            notice = await d.expect("notice", skip=("peer",))
            assert notice.transfer_id == "big" and notice.state == pb.TRANSFER_STATE_FAILED
            assert notice.reason == pb.REASON_TOO_LARGE and not notice.write_may_land
            limit = max_order_bytes(256 << 10)
            assert f"over the {limit}-byte message limit" in notice.detail
            await submit(ch, call("ok", "decode", wide(8)), call("ok", "prefill", wide(8)))
            told = await p.expect("notice", skip=("peer",))  # both engines are told
            assert told.transfer_id == "big" and told.reason == pb.REASON_TOO_LARGE
            order = await p.expect("order", skip=("peer",))
            assert order.transfer_id == "ok"  # the first and only order
            assert not p.ended.is_set() and not d.ended.is_set()
            assert [o.transfer_id for o in p.orders_seen] == ["ok"]
    finally:
        await p.close()
        await d.close()


def test_a_batch_over_the_bound_goes_as_several_messages_in_order() -> None:
    def order(i: int, n: int) -> pb.CoordinatorMessage:
        ids = pb.BlockIds(ids=range(2**14, 2**14 + n))  # 3-byte ids
        target = pb.WriteTarget(src_blocks=[ids], dst_blocks=[ids])
        return pb.CoordinatorMessage(order=pb.TransferOrder(transfer_id=f"t{i}", targets=[target]))

    small = pb.CoordinatorMessage(batch=pb.CoordinatorBatch(messages=[order(0, 10), order(1, 10)]))
    assert split_batch(small)[0] is small and len(split_batch(small)) == 1
    lone = order(9, 200_000)  # one message over the bound: it goes as it is
    assert split_batch(lone) == [lone]
    items = [order(0, 100_000), order(1, 10), order(2, 100_000), order(3, 100_000), order(4, 10)]
    items.insert(2, pb.CoordinatorMessage(notice=pb.TransferNotice(transfer_id="n")))
    parts = split_batch(pb.CoordinatorMessage(batch=pb.CoordinatorBatch(messages=items)), 700_000)
    flat = [m for p in parts for m in (p.batch.messages if p.HasField("batch") else [p])]
    assert flat == items
    assert len(parts) == 3 and all(p.ByteSize() <= 700_000 for p in parts)
    assert parts[1] == items[3]  # a part of one order goes unwrapped


async def test_orders_queued_together_past_4_mib_reach_a_batching_agent(
    coord: Coordinator,
) -> None:
    """Twelve orders of about 360 KB queued at once (one Submit of prefill
    reports): 4.3 MiB, more than one message may carry. Without the split the
    agent's stream ended at every replay."""
    p, d = await pair(coord.address)
    tids = [f"t{i}" for i in range(12)]
    try:
        async with grpc.aio.insecure_channel(coord.address) as ch:
            await submit(ch, *(call(t, "decode", wide()) for t in tids))
            await submit(ch, *(call(t, "prefill", wide(base=2**14 + 3)) for t in tids))
            got = [(await p.expect("order", timeout=10, skip=("peer",))).transfer_id for _ in tids]
            assert got == tids
            assert not p.ended.is_set() and p.batches_seen >= 3
    finally:
        await p.close()
        await d.close()
