"""NodeStream and the node relay (`pushkv relay`): a real coordinator, a real
relay, simulated agents over real gRPC (tests/support/sim_agent.py)."""

# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from pushkv.controlplane.server import Coordinator, ServerSettings, start
from pushkv.controlplane.settings import CoreSettings
from pushkv.net.batching import Batcher
from pushkv.relay.server import Relay, RelaySettings
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import (
    SimAgent,
    SimCluster,
    StreamEnded,
    hello,
    rendezvous,
    wait_terminal,
)

WAIT = 10.0


class Node:
    """A NodeStream driven by hand: NodeUp in, ChannelDown items out."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._up: asyncio.Queue[pb.NodeUp | None] = asyncio.Queue()
        self.call: Any = pbg.AgentServiceStub(channel).NodeStream(self._requests())
        self.downs = 0  # NodeDown messages received

    async def _requests(self) -> AsyncIterator[pb.NodeUp]:
        while (m := await self._up.get()) is not None:
            yield m

    def send(self, *items: pb.ChannelUp) -> None:
        self._up.put_nowait(pb.NodeUp(items=items))

    def end(self) -> None:
        self._up.put_nowait(None)

    async def items(self, n: int, timeout: float = WAIT) -> list[pb.ChannelDown]:
        """The next `n` channel items (from however many NodeDowns)."""
        got: list[pb.ChannelDown] = []

        async def read() -> None:
            while len(got) < n:
                down = await self.call.read()
                # grpc-stubs lacks aio.EOF
                assert down is not grpc.aio.EOF, f"the stream ended after {got}"  # type: ignore[attr-defined]
                self.downs += 1
                got.extend(down.items)

        await asyncio.wait_for(read(), timeout)
        return got


def up(channel: int, msg: pb.AgentMessage | None = None) -> pb.ChannelUp:
    if msg is None:
        return pb.ChannelUp(channel=channel, closed=True)
    return pb.ChannelUp(channel=channel, message=msg)


def heartbeat(seq: int) -> pb.AgentMessage:
    return pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq))


async def connected(address: str, engine_id: str) -> dict[int, bool]:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await pbg.StatusServiceStub(ch).ListEngines(pb.ListEnginesRequest())
    return {
        r.tp_rank: r.connected for e in resp.engines if e.engine_id == engine_id for r in e.ranks
    }


async def until(cond: Any, what: str) -> None:
    """Poll an async condition under a deadline (state read over gRPC)."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, f"not within {WAIT} s: {what}"
        await asyncio.sleep(0.02)


async def test_each_channel_of_a_node_stream_is_an_agent_stream(coord: Coordinator) -> None:
    async with grpc.aio.insecure_channel(coord.address) as ch:
        node = Node(ch)
        node.send(up(1, hello("p0", "prefill", 0, 2)), up(2, hello("p0", "prefill", 1, 2)))
        items = await node.items(2)
        assert {i.channel for i in items} == {1, 2}
        assert all(i.message.WhichOneof("kind") == "welcome" for i in items)
        assert await connected(coord.address, "p0") == {0: True, 1: True}

        # A channel whose first message is no hello ends alone, with AgentStream's
        # status; a late message on it is dropped, and the others go on.
        node.send(up(3, heartbeat(1)))
        (bad,) = await node.items(1)
        assert (bad.channel, bad.ended) == (3, True)
        assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "hello" in bad.detail
        node.send(up(3, heartbeat(2)), up(2, heartbeat(7)))
        (ack,) = await node.items(1)
        assert ack.channel == 2 and ack.message.heartbeat_ack.seq == 7

        # Closing a channel closes that agent's session only.
        node.send(up(1))

        async def rank0_gone() -> bool:
            return await connected(coord.address, "p0") == {0: False, 1: True}

        await until(rank0_gone, "rank 0 disconnected, rank 1 still connected")
        (ended,) = await node.items(1)
        assert (ended.channel, ended.ended, ended.code) == (1, True, 0)

        # Ending the stream closes every session on it.
        node.end()

        async def all_gone() -> bool:
            return await connected(coord.address, "p0") == {0: False, 1: False}

        await until(all_gone, "both ranks disconnected")
        node.call.cancel()


async def test_an_agent_hanging_up_fails_after_the_grace_a_relay_cut_off_waits_for_the_lease(
    coord: Coordinator,
) -> None:
    """A channel closed by the relay (its agent hung up) is a lost agent
    stream: the engine's moving transfer fails once the reconnect grace
    passes without its hello. A NodeStream that ends
    with its channels open (the relay died or was cut off) is not taken as
    the agents' death: their transfer stays ordered, for the agent to take
    back through a relay that returns, and fails only when the lease expires."""
    async with grpc.aio.insecure_channel(coord.address) as ch:
        status = pbg.StatusServiceStub(ch)
        hung = Node(ch)
        hung.send(up(1, hello("p0", "prefill")), up(2, hello("d0", "decode")))
        await hung.items(2)  # the welcomes
        await rendezvous(ch, "t-hung", prefill_engine="p0", decode_engine="d0")
        hung.send(up(1))  # the prefill agent's stream ended at the relay
        [t] = (await wait_terminal(ch, ["t-hung"], WAIT)).values()
        assert t.state == pb.TRANSFER_STATE_FAILED and t.reason == pb.REASON_AGENT_LOST
        grace_s = coord.runtime.core.settings.reconnect_grace_s
        assert f"disconnected and not back within {grace_s:g} s" in t.detail, t

        cut = Node(ch)
        cut.send(up(1, hello("p1", "prefill")), up(2, hello("d1", "decode")))
        await cut.items(2)
        await rendezvous(ch, "t-cut", prefill_engine="p1", decode_engine="d1")
        cut.call.cancel()  # the relay's stream ends, both channels open

        async def cut_off() -> bool:
            return await connected(coord.address, "p1") != {0: True}

        await until(cut_off, "the prefill rank disconnected")
        # Closing its session is what starts the grace: it has run, and the
        # transfer is still ordered.
        t = await status.GetTransfer(pb.GetTransferRequest(transfer_id="t-cut"))
        assert t.state == pb.TRANSFER_STATE_ORDERED, t
        lease_s = coord.runtime.core.settings.lease_s
        [t] = (await wait_terminal(ch, ["t-cut"], WAIT + lease_s)).values()
        assert t.state == pb.TRANSFER_STATE_FAILED and "lease expired" in t.detail, t
        hung.end()


async def test_a_hello_refused_on_a_channel_reaches_the_agent_through_the_relay(
    coord: Coordinator, relay: Relay
) -> None:
    good = SimAgent(relay.address, "p0", "prefill")
    await good.start()
    bad = SimAgent(relay.address, "p1", "prefill")
    bad.hello.hello.protocol_version += 1
    with pytest.raises(StreamEnded):
        await bad.start(WAIT)
    assert bad.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "upgrade the older side" in (bad.details or "")
    await bad.close()
    # The other agent's channel is untouched.
    assert await good.heartbeat(timeout=WAIT) is not None
    await good.close()


async def test_rendezvous_complete_through_one_relay_stream(
    coord: Coordinator, relay: Relay
) -> None:
    async with (
        SimCluster(relay.address, tp_size=4, batching=True) as cluster,
        grpc.aio.insecure_channel(coord.address) as ch,
    ):
        assert {a.welcome.coordinator_id for a in cluster.agents if a.welcome} == {
            coord.runtime.core.coordinator_id
        }
        ids = [f"t{i}" for i in range(20)]
        await asyncio.gather(*(rendezvous(ch, t) for t in ids))
        done = await wait_terminal(ch, ids, WAIT)
        assert {s.state for s in done.values()} == {pb.TRANSFER_STATE_COMPLETE}
        # Every rank's order reached it, and every decode rank counted its writer.
        assert all(len(p.orders_seen) == len(ids) for p in cluster.prefill)
        # The eight agent streams were one NodeStream at the coordinator, and
        # the status names the relay carrying each rank; an agent that dials
        # the coordinator itself is listed with none.
        assert relay.upstream.streams == 1
        assert await connected(coord.address, "d0") == {r: True for r in range(4)}
        async with SimAgent(coord.address, "x0", "decode"):
            resp = await pbg.StatusServiceStub(ch).ListEngines(pb.ListEnginesRequest())
        via = {(e.engine_id, r.tp_rank): r.relay for e in resp.engines for r in e.ranks}
        assert via.pop(("x0", 0)) == ""
        assert len(via) == 8 and all(v.startswith("ipv4:127.0.0.1:") for v in via.values()), via


async def test_a_restarted_coordinator_ends_the_streams_and_the_relay_dials_it_again(
    coord: Coordinator, relay: Relay
) -> None:
    port = coord.port
    agent = SimAgent(relay.address, "d0", "decode")
    await agent.start()
    await coord.stop(0)
    assert await agent.expect_end(WAIT) == grpc.StatusCode.UNAVAILABLE
    again = await start(ServerSettings(port=port, core=CoreSettings()))
    try:
        # The agent dials the relay again (as its link would, with backoff)
        # until the relay's new stream carries its hello.
        deadline = asyncio.get_running_loop().time() + WAIT
        while True:
            retry = SimAgent(relay.address, "d0", "decode", incarnation="i2")
            try:
                welcome = await retry.start(timeout=2.0)
                break
            except (AssertionError, grpc.aio.AioRpcError, TimeoutError):
                await retry.close()
                assert asyncio.get_running_loop().time() < deadline, "no welcome through the relay"
                await asyncio.sleep(0.1)
        assert welcome.coordinator_id == again.runtime.core.coordinator_id
        assert relay.upstream.streams >= 2
        await retry.close()
    finally:
        await again.stop(0)


async def test_a_relay_holds_a_hello_until_a_leader_accepts_it_then_refuses() -> None:
    settings = RelaySettings(coordinators="127.0.0.1:1", listen="127.0.0.1:0", hello_wait_s=0.5)
    r = await Relay(settings).start()
    try:
        agent = SimAgent(r.address, "p0", "prefill")
        with pytest.raises(StreamEnded):
            await agent.start(WAIT)
        assert agent.code == grpc.StatusCode.UNAVAILABLE
        assert "no coordinator accepted its stream within 0.5 s" in (agent.details or "")
        await agent.close()
    finally:
        await r.stop()


async def test_a_hello_held_while_no_coordinator_answers_is_welcomed_once_one_does() -> None:
    """A relay started before its coordinator: the agent's hello waits at the
    relay (no refusal, no backoff) and is welcomed once the coordinator is up."""
    from pushkv.harness.vllm_server import free_port

    port = free_port()
    r = await Relay(RelaySettings(coordinators=f"127.0.0.1:{port}", listen="127.0.0.1:0")).start()
    coord: Coordinator | None = None
    try:
        agent = SimAgent(r.address, "d0", "decode")
        waiting = asyncio.ensure_future(agent.start(WAIT))

        async def refused_once() -> bool:
            return r.upstream.streams >= 2  # the relay dialed and was refused

        await until(refused_once, "the relay dialed the absent coordinator twice")
        assert not waiting.done()
        coord = await start(ServerSettings(port=port, core=CoreSettings()))
        welcome = await waiting
        assert welcome.coordinator_id == coord.runtime.core.coordinator_id
        assert agent.code is None  # the stream the hello was held on: no refusal
        await agent.close()
    finally:
        await r.stop()
        if coord is not None:
            await coord.stop(0)


async def test_a_message_too_big_for_the_node_stream_ends_its_channel_only(
    coord: Coordinator, relay: Relay
) -> None:
    """An agent message that fits the relay's limit but not once wrapped in a
    NodeUp would make the coordinator end the whole NodeStream, and every
    channel of the node, again at each retry. The relay refuses it on that
    agent's stream alone (RESOURCE_EXHAUSTED, naming the sizes)."""
    async with (
        SimAgent(relay.address, "p0", "prefill") as big,
        SimAgent(relay.address, "d0", "decode") as other,
    ):
        limit = relay.settings.max_message_bytes
        msg = pb.AgentMessage(write=pb.WriteReport(order_id="o", transfer_id="t"))
        msg.write.detail = "x" * (limit - msg.ByteSize() - 8)
        assert limit - 64 < msg.ByteSize() <= limit  # the relay's own server takes it
        await big.send(msg)
        await asyncio.wait_for(big.ended.wait(), WAIT)
        assert big.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (big.code, big.details)
        assert f"{msg.ByteSize()} bytes" in (big.details or ""), big.details
        # The node's stream and the other agent's channel live on.
        assert await other.heartbeat(timeout=WAIT) is not None
        assert relay.upstream.streams == 1
        assert await connected(coord.address, "d0") == {0: True}


async def test_batches_are_bounded_by_count_and_bytes_and_never_wait() -> None:
    """pushkv/net/batching.py, as both ends of a NodeStream use it: an item that
    would pass the byte bound starts the next batch; a lone item over it still
    goes (as it would alone on an AgentStream); None ends the batches."""
    q: asyncio.Queue[pb.ChannelUp | None] = asyncio.Queue()
    big = pb.AgentMessage(hello=pb.AgentHello(nixl_metadata=b"x" * 600_000))
    for i in range(3):
        q.put_nowait(pb.ChannelUp(channel=i, message=big))
    q.put_nowait(pb.ChannelUp(channel=9, closed=True))
    q.put_nowait(None)
    b = Batcher(q, max_items=4, max_bytes=1 << 20)
    sizes = []
    while (batch := await b.next()) is not None:
        sizes.append([i.channel for i in batch])
    assert sizes == [[0], [1], [2, 9]]
    assert await b.next() is None

    q2: asyncio.Queue[pb.ChannelUp | None] = asyncio.Queue()
    for i in range(5):
        q2.put_nowait(pb.ChannelUp(channel=i, closed=True))
    b2 = Batcher(q2, max_items=2)
    assert [len(await b2.next() or []) for _ in range(3)] == [2, 2, 1]
    # Nothing queued: next() waits for the first item only.
    waiting = asyncio.ensure_future(b2.next())
    await asyncio.sleep(0)
    assert not waiting.done()
    q2.put_nowait(pb.ChannelUp(channel=7, closed=True))
    assert [i.channel for i in await asyncio.wait_for(waiting, WAIT) or []] == [7]


async def test_hellos_released_together_go_up_within_the_message_limit() -> None:
    """Eight agents whose hellos carry 900 KB of NIXL metadata each wait at a
    relay whose coordinator is not up yet; released together, as one NodeUp
    they would be 7 MB, past gRPC's 4 MiB limit (the stream would fail, and
    again on every retry). Bounded batches: all eight are welcomed."""
    from pushkv.harness.vllm_server import free_port

    port = free_port()
    r = await Relay(RelaySettings(coordinators=f"127.0.0.1:{port}", listen="127.0.0.1:0")).start()
    coord: Coordinator | None = None
    agents = [
        SimAgent(r.address, "big", "prefill", rank, 8, nixl_metadata=bytes([rank]) * 900_000)
        for rank in range(8)
    ]
    try:
        starts = [asyncio.ensure_future(a.start(WAIT)) for a in agents]

        async def all_waiting() -> bool:
            return r.upstream.streams >= 2 and not any(s.done() for s in starts)

        await until(all_waiting, "eight hellos held at the relay")
        coord = await start(ServerSettings(port=port, core=CoreSettings()))
        await asyncio.gather(*starts)
        assert await connected(coord.address, "big") == {rank: True for rank in range(8)}
        await asyncio.gather(*(a.close() for a in agents))
    finally:
        await r.stop()
        if coord is not None:
            await coord.stop(0)


async def test_heartbeats_wait_at_the_relay_for_company_and_keep_each_channels_order() -> None:
    """pushkv/relay/upstream.py, HEARTBEAT_HOLD_S: a heartbeat waits for the next
    message going up (held ones first) or for the hold, whichever is first."""
    from pushkv.relay.upstream import HEARTBEAT_HOLD_S, Channel, Generation

    g = Generation("coordinator")
    a, b = Channel(1, g), Channel(2, g)

    def next_up() -> pb.ChannelUp:
        item = g.up.get_nowait()
        assert item is not None  # None would end the stream
        return item

    # A channel's first heartbeat goes at once: an agent welcomed back by the
    # same leader resumes posting at its ack (agent/link.py).
    assert a.send(heartbeat(0)) and b.send(heartbeat(0)) and not g.held
    assert [(i.channel, i.message.heartbeat.seq) for i in (next_up(), next_up())] == [
        (1, 0),
        (2, 0),
    ]
    assert a.send(heartbeat(1)) and b.send(heartbeat(1))
    assert g.up.empty()  # held
    report = pb.AgentMessage(arrival=pb.ArrivalReport(transfer_id="t", prefill_ranks=[0]))
    assert a.send(report)
    got = [next_up() for _ in range(3)]
    assert [(i.channel, i.message.WhichOneof("kind")) for i in got] == [
        (1, "heartbeat"),
        (2, "heartbeat"),
        (1, "arrival"),
    ]
    # Alone, a heartbeat goes once the hold is over (awaited, not slept on).
    assert b.send(heartbeat(2))
    assert g.up.empty() and g.held  # until HEARTBEAT_HOLD_S
    item = await asyncio.wait_for(g.up.get(), WAIT + HEARTBEAT_HOLD_S)
    assert item is not None and item.message.heartbeat.seq == 2 and not g.held
    assert b.send(heartbeat(3))
    g.close(grpc.StatusCode.UNAVAILABLE, "gone")  # a held heartbeat dies with its stream
    assert g.held == [] and g._flusher is None


async def test_a_nodes_idle_heartbeats_share_node_up_messages(
    coord: Coordinator, relay: Relay
) -> None:
    async with SimCluster(relay.address, tp_size=4) as cluster:
        for a in cluster.agents:  # each channel's first heartbeat goes at once
            await a.heartbeat(wait_ack=False)
        assert len([await asyncio.wait_for(a.acks.get(), WAIT) for a in cluster.agents]) == 8
        before = relay.upstream.up_messages
        for a in cluster.agents:  # one after another, as their timers fire
            await a.heartbeat(wait_ack=False)
        acks = [await asyncio.wait_for(a.acks.get(), WAIT) for a in cluster.agents]
        assert len(acks) == 8  # every one answered, through the hold
        assert relay.upstream.up_messages - before <= 2  # not one NodeUp each
