"""The scheduler half's coordinator client against a real coordinator.

Calls go out as Submit batches; each call keeps its own outcome; a coordinator
without Submit (an older release) is served one unary RPC per call.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pushkv.controlplane.servicers import TransferServicer
from pushkv.controlplane.settings import CoreSettings
from pushkv.rules import block_groups
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration import client as client_mod
from pushkv.vllm_integration.client import Call, CoordinatorClient, Result, needs_engine
from tests.support.sim_agent import SimCluster, ThreadedCoordinator
from tests.support.waits import wait_until

DEADLINE_S = 20.0


def _serve() -> Iterator[ThreadedCoordinator]:
    with ThreadedCoordinator() as tc:
        cluster = SimCluster(tc.address, auto_complete=False)
        tc.run(cluster.start())
        yield tc
        tc.run(cluster.close())


@pytest.fixture
def server() -> Iterator[ThreadedCoordinator]:
    yield from _serve()


@pytest.fixture
def old_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadedCoordinator]:
    """An older coordinator: its TransferService has no Submit (UNIMPLEMENTED)."""

    async def no_submit(
        self: object, request: object, context: grpc.aio.ServicerContext[object, object]
    ) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(TransferServicer, "Submit", no_submit)
    yield from _serve()


def results_for(client: CoordinatorClient, n: int) -> list[Result]:
    """Wait for n results in total (bounded) and drain them."""
    got: list[Result] = []
    while len(got) < n:
        r = client.wait_result(lambda _: True, DEADLINE_S)
        assert r is not None, f"only {len(got)} of {n} results within {DEADLINE_S} s"
        got += client.drain()
    return got


def calls(n: int) -> list[Call]:
    out: list[Call] = []
    for i in range(n):
        tid = f"batch-{i}"
        out.append(Call("register", f"d{i}", tid, "d0", block_groups.of((10 + i, 11 + i)), 40))
        out.append(Call("prefill_done", f"p{i}", tid, "p0", block_groups.of((1, 2, 3)), 40))
    return out


def test_calls_are_batched_and_each_keeps_its_outcome(server: ThreadedCoordinator) -> None:
    client = CoordinatorClient(server.address, timeout_s=5.0)
    try:
        sent = calls(100)
        # A call the coordinator refuses sits between accepted ones.
        sent.insert(
            7, Call("register", "bad", "batch-bad", "no-such-engine", block_groups.of((1,)), 40)
        )
        for c in sent:
            client.submit(c)
        got = results_for(client, len(sent))
        assert [r.call for r in got] == sent  # one result per call, in order
        bad = got[7]
        assert bad.refused and bad.error.startswith("FAILED_PRECONDITION")
        for r in got[:7] + got[8:]:
            assert r.ok, r.error
            assert r.state in (
                pb.TRANSFER_STATE_REGISTERED,
                pb.TRANSFER_STATE_PREFILL_DONE,
                pb.TRANSFER_STATE_ORDERED,
                pb.TRANSFER_STATE_WRITING,
                pb.TRANSFER_STATE_COMPLETE,
            )
        # 201 calls went out in fewer RPCs than calls (the thread drains the queue).
        assert 1 <= client.batches_sent < len(sent)
    finally:
        client.close()


def test_only_results_the_engine_must_act_on_are_queued(server: ThreadedCoordinator) -> None:
    client = CoordinatorClient(server.address, timeout_s=5.0, keep=needs_engine)
    try:
        sent = calls(20)  # accepted: dropped on the client thread
        refused = Call("register", "bad", "keep-bad", "no-such-engine", block_groups.of((1,)), 40)
        cancel = Call("cancel", "c1", "keep-cancel", reason="test")  # always handed on
        sent[5:5] = [refused, cancel]
        for c in sent:
            client.submit(c)
        assert client.wait_answered(len(sent), DEADLINE_S)
        got = client.drain()
        assert [r.call for r in got] == [refused, cancel]
        assert got[0].refused and got[1].ok
        assert client.answered == len(sent)
    finally:
        client.close()


def test_needs_engine_keeps_failures_cancels_and_ended_transfers() -> None:
    reg = Call("register", "r", "t")
    done = Call("prefill_done", "p", "t")
    live, ended = pb.TRANSFER_STATE_REGISTERED, pb.TRANSFER_STATE_CANCELLED
    assert not needs_engine(Result(reg, live))
    assert not needs_engine(Result(done, pb.TRANSFER_STATE_ORDERED))
    # Ended while a WRITE may still land: nothing to do until the agent says so.
    assert not needs_engine(Result(done, pb.TRANSFER_STATE_COMPLETE, write_may_land=True))
    assert needs_engine(Result(reg, ended))  # no WRITE will come: fail the load now
    assert needs_engine(Result(done, ended))  # free the blocks now
    assert needs_engine(Result(reg, 0, "UNAVAILABLE: down"))  # outcome unknown
    assert needs_engine(Result(done, 0, "FAILED_PRECONDITION: x", refused=True))
    assert needs_engine(Result(Call("cancel", "c", "t"), ended))


def test_a_sleeping_client_thread_is_woken_by_each_submit(
    server: ThreadedCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Idle, the thread would sleep a minute: only submit() can wake it in time.
    monkeypatch.setattr(client_mod, "IDLE_WAKE_S", 60.0)
    client = CoordinatorClient(server.address, timeout_s=5.0)
    try:
        for c in calls(3):  # each round trip ends with the thread asleep again
            wait_until(lambda: client._sleeping, "the client thread goes to sleep")
            client.submit(c)
            assert [r.call for r in results_for(client, 1)] == [c]
    finally:
        client.close()
    assert not client._thread.is_alive()  # close() woke it too


def test_a_coordinator_without_submit_gets_unary_calls(old_server: ThreadedCoordinator) -> None:
    client = CoordinatorClient(old_server.address, timeout_s=5.0)
    try:
        sent = calls(5)
        for c in sent:
            client.submit(c)
        got = results_for(client, len(sent))
        assert [r.call for r in got] == sent
        assert all(r.ok for r in got), [r.error for r in got]
        assert client.batches_sent == 0
    finally:
        client.close()


def test_an_unreachable_coordinator_fails_every_call_as_unknown_outcome() -> None:
    client = CoordinatorClient("127.0.0.1:1", timeout_s=0.5, attempts=2)
    try:
        sent = calls(2)
        for c in sent:
            client.submit(c)
        got = results_for(client, len(sent))
        assert [r.call for r in got] == sent
        # Not refused: the coordinator may or may not hold them.
        assert all(not r.ok and not r.refused for r in got)
        assert all(r.error.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")) for r in got)
    finally:
        client.close()


def test_a_newer_term_resubmits_the_open_calls_flagged() -> None:
    """The coordinator starts leading a newer term (as a new leader would
    after a failover; its state is kept here, so the resubmitted transfer is
    one no agent re-sent): the client resubmits its open call with the flag,
    UNAVAILABLE within the rebuild window, FAILED after it; a settled call is
    never resubmitted, a new call is not affected."""
    with ThreadedCoordinator(CoreSettings(rebuild_window_s=0.5)) as tc:
        cluster = SimCluster(tc.address, auto_complete=False)
        tc.run(cluster.start())
        client = CoordinatorClient(tc.address, timeout_s=5.0)
        try:
            client.submit(Call("register", "d1", "rs-open", "d0", block_groups.of((10, 11)), 40))
            client.submit(Call("register", "d2", "rs-settled", "d0", block_groups.of((12, 13)), 40))
            assert client.wait_answered(2, DEADLINE_S)
            client.settle("d2", "rs-settled")
            assert client.wait_open(lambda open_: open_ == {"rs-open"}, DEADLINE_S)
            assert client.term == 0

            async def lead() -> None:
                assert tc.coordinator is not None
                tc.coordinator.runtime.lead(5)

            tc.run(lead())
            client.submit(Call("register", "d3", "rs-new", "d0", block_groups.of((14, 15)), 40))
            res = client.wait_result(
                lambda r: r.call.transfer_id == "rs-open" and r.terminal, DEADLINE_S
            )
            assert res is not None and res.state == pb.TRANSFER_STATE_FAILED, res
            assert client.term == 5 and client.resubmitted >= 1
            assert client.resubmit_accepted == client.resubmit_failed == 1
            assert client.wait_open(lambda open_: open_ == {"rs-new"}, DEADLINE_S)
            with grpc.insecure_channel(tc.address) as ch:
                st = pbg.StatusServiceStub(ch)

                def state(tid: str) -> pb.TransferStatus:
                    return st.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)

                gone = state("rs-open")
                assert "no agent of engine d0 re-sent" in gone.detail, gone
                assert state("rs-settled").state == pb.TRANSFER_STATE_REGISTERED
                assert state("rs-new").state == pb.TRANSFER_STATE_REGISTERED
        finally:
            client.close()
            tc.run(cluster.close())
