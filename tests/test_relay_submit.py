"""Submits carried by a node relay (`pushkv relay`) on its one NodeStream: a
real coordinator, a real relay, simulated agents and the connector's own
scheduler client over real gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pushkv.controlplane.leadership import Role, View
from pushkv.controlplane.server import Coordinator
from pushkv.controlplane.servicers import MAX_SUBMIT_CALLS
from pushkv.relay.server import Relay, RelaySettings
from pushkv.relay.upstream import Generation, RelayError, Upstream
from pushkv.rules import block_groups
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.client import Call, CoordinatorClient, Result
from tests.support.sim_agent import SimCluster, blocks, hello, wait_terminal
from tests.test_relay import Node, up

WAIT = 10.0


def _register(tid: str) -> pb.TransferCall:
    return pb.TransferCall(
        register=pb.RegisterDecodeBlocksRequest(
            transfer_id=tid, decode_engine_id="d0", block_ids=blocks([7, 8, 9]), num_tokens=40
        )
    )


async def _result(client: CoordinatorClient, request_id: str) -> Result:
    """The client's answer to `request_id` (its thread; the loop keeps serving)."""
    res = await asyncio.to_thread(
        client.wait_result, lambda r: r.call.request_id == request_id, WAIT
    )
    assert res is not None, f"no answer to {request_id} within {WAIT} s"
    return res


async def test_the_scheduler_clients_submits_go_up_the_relays_stream(
    coord: Coordinator, relay: Relay
) -> None:
    """The connector's client, given the relay's address, is answered call by
    call as by the coordinator, and the rendezvous complete: the decode and
    prefill sides went up as relayed Submits, not as RPCs of their own."""
    client = CoordinatorClient(relay.address, timeout_s=5.0)
    try:
        async with (
            SimCluster(relay.address, tp_size=2, batching=True) as cluster,
            grpc.aio.insecure_channel(coord.address) as ch,
        ):
            ids = [f"rs{i}" for i in range(6)]
            for i, tid in enumerate(ids):
                client.submit(Call("register", f"d{i}", tid, "d0", block_groups.of((7, 8, 9)), 40))
            for i in range(len(ids)):
                res = await _result(client, f"d{i}")
                assert res.ok and res.state == pb.TRANSFER_STATE_REGISTERED, res
            for i, tid in enumerate(ids):
                client.submit(
                    Call("prefill_done", f"p{i}", tid, "p0", block_groups.of((1, 2, 3)), 40)
                )
            # A call the coordinator refuses fails alone, with its own status.
            client.submit(
                Call("prefill_done", "bad", "rs-bad", "p0", block_groups.of((1, 2, 3)), 0)
            )
            bad = await _result(client, "bad")
            assert not bad.ok and "INVALID_ARGUMENT" in bad.error, bad
            for i in range(len(ids)):
                assert (await _result(client, f"p{i}")).ok
            done = await wait_terminal(ch, ids, WAIT)
            assert {s.state for s in done.values()} == {pb.TRANSFER_STATE_COMPLETE}
            assert all(len(p.orders_seen) == len(ids) for p in cluster.prefill)
        assert client.batches_sent >= 2  # the registrations, then the reports
        assert relay.upstream.submits == client.batches_sent
        assert relay.upstream.streams == 1  # agents and Submits on one stream
    finally:
        client.close()


async def test_a_relayed_submit_refused_whole_gets_the_coordinators_status(
    coord: Coordinator, relay: Relay
) -> None:
    """A Submit the coordinator refuses as a whole answers its status through
    the relay; the relay refuses the calls it cannot carry itself."""
    async with (
        SimCluster(relay.address),
        grpc.aio.insecure_channel(relay.address) as ch,
    ):
        stub = pbg.TransferServiceStub(ch)
        too_many = pb.SubmitRequest(calls=[_register(f"m{i}") for i in range(MAX_SUBMIT_CALLS + 1)])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Submit(too_many, timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {MAX_SUBMIT_CALLS}" in (err.value.details() or "")

        # The one-call RPCs are the coordinator's: the relay names it.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterDecodeBlocks(_register("u1").register, timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert coord.address in (err.value.details() or "")

        # An ordinary one on the same stream is answered.
        ok = await stub.Submit(pb.SubmitRequest(calls=[_register("ok1")]), timeout=WAIT)
        assert [r.code for r in ok.results] == [0]
        assert ok.term == coord.runtime.term


async def test_a_relayed_submit_is_answered_on_the_node_stream_by_its_id(
    coord: Coordinator,
) -> None:
    """At the coordinator: relayed Submits on channel 0 are applied in stream
    order after the hello before them, and answered in order by their ids."""
    async with grpc.aio.insecure_channel(coord.address) as ch:
        node = Node(ch)
        first = await node.call.read()
        assert first.takes_submit and not first.items  # accepted, and says so
        node.send(
            up(1, hello("d0", "decode", 0, 1)),  # d0's one rank, then d0's registration
            pb.ChannelUp(submit=pb.RelayedSubmit(id=41, request=pb.SubmitRequest())),
            pb.ChannelUp(
                submit=pb.RelayedSubmit(id=42, request=pb.SubmitRequest(calls=[_register("n1")]))
            ),
            up(2, pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1))),  # no hello: ends channel 2
        )
        items = await node.items(4)
        (welcome,) = [i for i in items if i.channel == 1]
        assert welcome.message.WhichOneof("kind") == "welcome"
        replies = [i.submitted for i in items if i.HasField("submitted")]
        assert [(r.id, r.code, len(r.response.results)) for r in replies] == [
            (41, 0, 0),
            (42, 0, 1),
        ]
        assert replies[1].response.results[0].state == pb.TRANSFER_STATE_REGISTERED
        (ended,) = [i for i in items if i.channel == 2]
        assert ended.ended and ended.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        node.end()


async def test_without_an_accepting_coordinator_a_relayed_submit_fails_unavailable() -> None:
    settings = RelaySettings(coordinators="127.0.0.1:1", listen="127.0.0.1:0")
    r = await Relay(settings).start()
    try:
        async with grpc.aio.insecure_channel(r.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pbg.TransferServiceStub(ch).Submit(
                    pb.SubmitRequest(calls=[_register("x")]), timeout=0.5
                )
        # The caller's deadline bounds the wait (its own, or the relay's answer).
        assert err.value.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ), err.value
    finally:
        await r.stop()


async def test_a_stream_that_ends_answers_its_pending_submits_unavailable() -> None:
    """The relay's bookkeeping (no coordinator needed to break a stream): a
    Submit waiting on a stream that ends is answered UNAVAILABLE, which the
    scheduler's client retries (its calls are idempotent); and a coordinator
    that did not say it takes Submits on the stream is named, not waited on."""
    upstream = Upstream("127.0.0.1:1")
    gen = Generation("127.0.0.1:1", answered=True, takes_submit=True)
    upstream._gen = gen  # as _stream sets it once the leader accepted
    waiting = asyncio.ensure_future(upstream.submit(pb.SubmitRequest(), WAIT))
    queued = await asyncio.wait_for(gen.up.get(), WAIT)  # the Submit, queued for the stream
    assert queued is not None and queued.HasField("submit") and len(gen.pending) == 1
    gen.close(grpc.StatusCode.UNAVAILABLE, "relay: the stream to 127.0.0.1:1 ended")
    with pytest.raises(RelayError) as err:
        await asyncio.wait_for(waiting, WAIT)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "ended before the Submit was answered" in err.value.detail
    assert not gen.pending

    upstream._gen = Generation("127.0.0.1:1", answered=True, takes_submit=False)
    with pytest.raises(RelayError) as err:
        await upstream.submit(pb.SubmitRequest(), WAIT)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "takes no Submit on a node stream" in err.value.detail


async def test_a_replica_that_may_no_longer_order_applies_no_relayed_submit(
    coord: Coordinator,
) -> None:
    """A leader whose lease ran out (it may no longer order) applies no relayed
    Submit: the fence runs first, and its stream ends UNAVAILABLE, which a
    relay answers its pending Submits with (the client sends them again)."""
    async with grpc.aio.insecure_channel(coord.address) as ch:
        node = Node(ch)
        assert (await node.call.read()).takes_submit
        node.send(up(1, hello("d0", "decode", 0, 1)))
        (welcome,) = await node.items(1)
        assert welcome.message.WhichOneof("kind") == "welcome"
        # Leading, but past the deadline its lease allowed it to order until.
        coord.leadership.update(View(Role.LEADER, "self:1", 7), order_deadline=0.0)
        node.send(
            pb.ChannelUp(
                submit=pb.RelayedSubmit(id=1, request=pb.SubmitRequest(calls=[_register("f1")]))
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await node.items(1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not coord.runtime.core.has_transfer("f1")


def _prefill_done(tid: str) -> pb.TransferCall:
    return pb.TransferCall(
        prefill_done=pb.ReportPrefillDoneRequest(
            transfer_id=tid, prefill_engine_id="p0", block_ids=blocks([1, 2, 3]), num_tokens=40
        )
    )


async def test_a_rendezvous_answer_and_its_orders_go_down_as_one_node_down(
    coord: Coordinator,
) -> None:
    """The Submit that completes a TP-4 rendezvous, read from a NodeUp: its
    answer and the orders to the four prefill channels go down together, in
    one NodeDown, not one message per channel."""
    async with grpc.aio.insecure_channel(coord.address) as ch:
        node = Node(ch)
        assert (await node.call.read()).takes_submit
        node.send(
            *(up(r + 1, hello("p0", "prefill", r, 4)) for r in range(4)),
            *(up(r + 5, hello("d0", "decode", r, 4)) for r in range(4)),
        )
        welcomes = await node.items(8)
        assert {i.message.WhichOneof("kind") for i in welcomes} == {"welcome"}
        request = pb.SubmitRequest(calls=[_register("b1"), _prefill_done("b1")])
        downs = node.downs
        node.send(pb.ChannelUp(submit=pb.RelayedSubmit(id=9, request=request)))
        items = await node.items(5)
        assert node.downs == downs + 1, items
        (reply,) = [i.submitted for i in items if i.HasField("submitted")]
        assert reply.id == 9 and [r.code for r in reply.response.results] == [0, 0]
        ordered = {i.channel for i in items if not i.HasField("submitted")}
        assert ordered == {1, 2, 3, 4}
        node.end()
