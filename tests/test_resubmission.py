"""A new leader's answer to resubmitted sides (controlplane/resubmission.py),
driven directly with a fake clock (no gRPC), in the style of test_adoption.py;
and once through a real in-process server's Submit."""

from __future__ import annotations

import grpc
import pytest

from pushkv.controlplane.domain import (
    AgentKey,
    EngineId,
    HeldTransfer,
    Reason,
    Role,
    State,
    WriteStatus,
)
from pushkv.controlplane.errors import FailedPrecondition, Unavailable
from pushkv.controlplane.server import ServerSettings, start
from pushkv.controlplane.settings import CoreSettings
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimAgent
from tests.test_adoption import hello, leader
from tests.test_rendezvous import D, P, notices, orders

WINDOW = 4.0


def test_a_side_an_agent_re_sent_is_accepted_and_the_transfer_completes() -> None:
    rv, _ = leader(rebuild_window_s=WINDOW)
    rv.lead()
    hello(rv, P, Role.PREFILL, 0, 1, HeldTransfer("t"))  # blocks held, not ordered yet
    hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("t"))
    t, _ = rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    assert t.state is State.REGISTERED and t.adopting
    t, effects = rv.prefill_done("t", P, [[1, 2]], 20, resubmitted=True)
    [o] = orders(effects)  # one order, of this leader
    assert o.order.order_id.startswith(rv.coordinator_id)
    rv.write_report(o.to, "i1", o.order.order_id, "t", WriteStatus.DONE)
    rv.arrival_report(AgentKey(D, 0), "i1", "t", [0])
    assert t.state is State.COMPLETE and t.reason is Reason.NONE
    # A resubmission retried after that answers the end state, orders nothing.
    t, effects = rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    assert t.state is State.COMPLETE and orders(effects) == []


def test_before_the_engines_agents_are_back_it_is_unavailable_and_nothing_recorded() -> None:
    rv, clock = leader(rebuild_window_s=WINDOW)
    rv.lead()
    hello(rv, P, Role.PREFILL, 0, 1)
    clock.advance(WINDOW - 0.5)
    with pytest.raises(Unavailable, match="waits for their hellos"):
        rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    assert not rv.has_transfer("t") and rv.inflight == 0
    # The decode agent's hello comes back, re-sending it: the retry is accepted.
    hello(rv, D, Role.DECODE, 0, 1, HeldTransfer("t"))
    t, _ = rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    assert t.state is State.REGISTERED and t.decode is not None


def test_tp2_one_rank_back_is_not_enough_every_rank_back_without_it_fails_at_once() -> None:
    rv, _ = leader(rebuild_window_s=WINDOW)
    rv.lead()
    hello(rv, D, Role.DECODE, 0, 2)  # rank 1 is still reconnecting
    with pytest.raises(Unavailable):
        rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    hello(rv, D, Role.DECODE, 1, 2)  # back, and neither rank holds "t"
    t, effects = rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    assert t.state is State.FAILED and orders(effects) == []  # within the window


def test_after_the_window_an_unknown_transfer_fails_and_is_never_ordered() -> None:
    rv, clock = leader(rebuild_window_s=WINDOW)
    rv.lead()
    hello(rv, P, Role.PREFILL, 0, 1)
    hello(rv, D, Role.DECODE, 0, 1)
    clock.advance(WINDOW)
    t, effects = rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    assert t.state is State.FAILED and not t.write_may_land and orders(effects) == []
    assert "no agent of engine decode-0 re-sent" in t.detail and t.decode is None
    # The other side (resubmitted or reported anew) learns the end: no order.
    t, effects = rv.prefill_done("t", P, [[1, 2]], 20)
    assert t.state is State.FAILED and orders(effects) == []
    t, effects = rv.prefill_done("t", P, [[1, 2]], 20, resubmitted=True)
    assert t.state is State.FAILED and orders(effects) == []
    assert rv.inflight == 0


def test_a_transfer_only_the_other_engine_re_sent_waits_then_fails_telling_it() -> None:
    rv, clock = leader(rebuild_window_s=WINDOW)
    rv.lead()
    hello(rv, P, Role.PREFILL, 0, 1, HeldTransfer("t"))  # prefill still holds its blocks
    with pytest.raises(Unavailable):  # the decode agent is not back yet
        rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    clock.advance(WINDOW)  # it never comes back within the window
    t, effects = rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    assert t.state is State.FAILED and orders(effects) == []
    [n] = notices(effects, AgentKey(P, 0))  # the prefill engine frees its blocks
    assert n.notice.state is State.FAILED and not n.notice.write_may_land


def test_a_normal_submit_is_unaffected_by_the_window() -> None:
    rv, _ = leader(rebuild_window_s=WINDOW)
    rv.lead()
    hello(rv, P, Role.PREFILL, 0, 1)
    hello(rv, D, Role.DECODE, 0, 1)
    rv.begin("n", P, D)
    t, effects = rv.register_decode("n", D, [[5, 6]], 20)  # a new request: armed at once
    assert t.state is State.ARMED and len(orders(effects)) == 1
    t, effects = rv.prefill_done("m", P, [[1, 2]], 20)
    assert t.state is State.PREFILL_DONE


def test_within_the_window_an_engine_whose_agents_are_not_back_is_unavailable() -> None:
    rv, clock = leader(rebuild_window_s=WINDOW)
    rv.lead()
    hello(rv, P, Role.PREFILL, 0, 1)  # the decode agents are still reconnecting
    with pytest.raises(Unavailable, match="reconnecting"):
        rv.register_decode("n", D, [[5, 6]], 20)  # a new side, not a resubmission
    assert not rv.has_transfer("n")
    clock.advance(WINDOW)
    with pytest.raises(FailedPrecondition, match="no registered agents"):
        rv.register_decode("n", D, [[5, 6]], 20)


def test_a_transfer_that_ended_here_answers_its_end() -> None:
    rv, _ = leader(rebuild_window_s=WINDOW)
    rv.lead()
    hello(rv, D, Role.DECODE, 0, 1)
    rv.cancel("c", "router cancelled")
    t, effects = rv.register_decode("c", D, [[5, 6]], 20, resubmitted=True)
    assert t.state is State.CANCELLED and orders(effects) == []


def test_a_coordinator_that_never_led_a_term_fails_resubmissions_at_once() -> None:
    rv, _ = leader()  # no lead(): the single coordinator (term 0), no window
    hello(rv, D, Role.DECODE, 0, 1)
    t, _ = rv.register_decode("t", D, [[5, 6]], 20, resubmitted=True)
    assert t.state is State.FAILED
    assert CoreSettings().rebuild_window_s == 10.0


# ---------------------------------------------------------------- over gRPC


async def test_over_grpc_submit_carries_the_term_and_the_flag() -> None:
    c = await start(ServerSettings(port=0, core=CoreSettings(rebuild_window_s=60.0)))
    c.runtime.lead(9)
    d = SimAgent(c.address, "d0", "decode")
    d.hello.hello.term = 8  # it followed the old leader
    d.hello.hello.held.add(transfer_id="adopted")
    try:
        await d.start()
        async with grpc.aio.insecure_channel(c.address) as ch:
            stub = pbg.TransferServiceStub(ch)

            def call(tid: str, resubmitted: bool, engine: str = "d0") -> pb.TransferCall:
                req = pb.RegisterDecodeBlocksRequest(
                    transfer_id=tid, decode_engine_id=engine, num_tokens=20
                )
                req.block_ids.add(ids=[5, 6])
                return pb.TransferCall(register=req, resubmitted=resubmitted)

            reply = await stub.Submit(
                pb.SubmitRequest(
                    calls=[
                        call("adopted", True),
                        call("unknown", True),  # d0 is back without it
                        call("new", False),
                        call("elsewhere", True, engine="d9"),  # d9's agents not back
                    ]
                )
            )
            assert reply.term == 9
            ok, gone, new, wait = reply.results
            assert (ok.code, ok.state) == (0, pb.TRANSFER_STATE_REGISTERED)
            assert (gone.code, gone.state) == (0, pb.TRANSFER_STATE_FAILED)
            assert (new.code, new.state) == (0, pb.TRANSFER_STATE_REGISTERED)
            assert wait.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert "waits for their hellos" in wait.message
            empty = await stub.Submit(pb.SubmitRequest())  # a probe: the term only
            assert empty.term == 9 and not empty.results
    finally:
        await d.close()
        await c.stop(0)


def test_engine_ids_are_validated() -> None:
    rv, _ = leader()
    with pytest.raises(Exception, match="engine_id"):
        rv.register_decode("t", EngineId("bad id|x"), [[1]], 10, resubmitted=True)
