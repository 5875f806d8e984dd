"""The scheduler client resubmits its open calls to a new leader
(docs/reliability.md, "Scheduler resubmission"): real etcd, two real
coordinator replicas, KV hosts whose agents rebuild, and the connector's
CoordinatorClient given both addresses. After the leader's kill -9 the test
sends nothing itself for the transfers in flight: the client notices the new
term (its idle probe), resubmits the sides an older leader accepted with the
flag, and the transfers complete through the new leader, bytes verified.
Waits are polls or events under deadlines; times are printed, never asserted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import leadership
from pushkv.rules import block_groups
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.client import Call, CoordinatorClient, Result
from tests.support.etcd import EtcdServer, etcd, require_etcd  # noqa: F401  (the fixture)
from tests.support.kvpair import wait_state
from tests.test_ha import (
    CANARY,
    DEADLINE_S,
    NB,
    Cluster,
    _register_and_done,
    _submit,
    _transfer,
    _wait_ready,
    poll,
    rebuilding_hosts,
    running_replicas,
)

pytestmark = pytest.mark.faults

WINDOW_S = 10.0  # the replicas' --rebuild-window-s (the default)


@pytest.fixture
def cluster(etcd: EtcdServer) -> Iterator[Cluster]:  # noqa: F811
    with running_replicas(etcd, "--rebuild-window-s", str(WINDOW_S)) as c:
        yield c


def test_open_calls_are_resubmitted_to_the_new_leader_and_complete(cluster: Cluster) -> None:
    lead = cluster.leader()
    (standby,) = cluster.standbys()
    both = f"{lead.address},{standby.address}"
    p, d = rebuilding_hosts(both)
    client = CoordinatorClient(both, timeout_s=2.0)
    try:
        p.start()
        d.start()
        d.call("canary", CANARY)
        _wait_ready(lead.address)
        old_term = leadership(lead.address).term  # type: ignore[union-attr]
        # rs-written: written in full before the kill (KV_READY at decode), but
        # neither engine's scheduler settled it yet: both sides stay open.
        _transfer(client, lead.address, p, d, "rs-written", seed=60)
        assert d.call("ready") == [("rs-written", (0,))]  # re-sent in the next hello
        # rs-registered: decode registered only (prefill reports after the kill).
        # rs-ordered: both sides in, the WRITE held unposted at the prefill agent.
        p.fill([3, 4], seed=61)
        p.fill([5, 6], seed=62)
        d.call("expect", ["rs-registered", "rs-ordered"])
        _submit(client, Call("register", "r1", "rs-registered", "D", block_groups.of((22, 23)), 20))
        p.call("pause", True)
        _register_and_done(client, p, "rs-ordered", [24, 25], [5, 6])
        # rs-gone: accepted by the old leader, but no agent holds it (the decode
        # agent was never told to expect it): its resubmission must fail.
        _submit(client, Call("register", "r3", "rs-gone", "D", block_groups.of((26, 27)), 20))
        # rs-settled: the engine is done with it; never resubmitted.
        _submit(client, Call("register", "r4", "rs-settled", "D", block_groups.of((28, 29)), 20))
        client.settle("r4", "rs-settled")
        want = {"rs-registered", "rs-ordered", "rs-gone", "rs-written"}
        assert client.wait_open(lambda open_: open_ == want, DEADLINE_S)
        assert client.term == old_term
        poll(lambda: any(h[0] == "rs-ordered" and h[2] for h in p.call("held")), "held unposted")
        written = p.call("writes_posted")

        killed = time.monotonic()
        lead.kill()
        # Nothing is sent for these transfers by the test: the client probes,
        # follows the new leader and resubmits on its own.
        gone = client.wait_result(
            lambda r: r.call.transfer_id == "rs-gone" and r.state == pb.TRANSFER_STATE_FAILED,
            DEADLINE_S,
        )
        assert gone is not None and gone.terminal and not gone.write_may_land, gone
        # Its resubmitted sides are answered COMPLETE: every decode rank's hello
        # said it was written; it is not FAILED and never ordered again.
        for kind in ("register", "prefill_done"):

            def written_side(r: Result, k: str = kind) -> bool:
                return r.call.transfer_id == "rs-written" and r.call.kind == k and r.terminal

            done = client.wait_result(written_side, DEADLINE_S)
            assert done is not None and done.state == pb.TRANSFER_STATE_COMPLETE, done
        new_term = client.term
        assert new_term > old_term and client._follower.current == standby.address
        p.call("pause", False)
        # The prefill side of rs-registered finishes after the kill (a new call).
        p.call("hold", ["rs-registered"])
        _submit(
            client, Call("prefill_done", "p1", "rs-registered", "P", block_groups.of((3, 4)), 20)
        )
        for tid, dst, seed in (("rs-registered", [22, 23], 61), ("rs-ordered", [24, 25], 62)):
            assert d.wait_event(tid, DEADLINE_S).kind is EventKind.KV_READY, tid
            assert d.check(dst, seed=seed) == [], tid
            assert p.wait_event(tid, DEADLINE_S).kind is EventKind.BLOCKS_FREE, tid
            with grpc.insecure_channel(standby.address) as ch:
                t = wait_state(pbg.StatusServiceStub(ch), tid, pb.TRANSFER_STATE_COMPLETE, 10)
            assert t.state == pb.TRANSFER_STATE_COMPLETE, (tid, t)
            assert "adopted" in [e.stage for e in t.timeline], t
        completed = time.monotonic() - killed
        print(
            f"resubmitted {client.resubmitted} calls ({client.resubmit_accepted} accepted, "
            f"{client.resubmit_ended} answered with their end, {client.resubmit_failed} "
            "failed); the two transfers in flight complete "
            f"{completed:.3f} s after the kill -9"
        )
        # Ended there: rs-gone (FAILED) and both sides of rs-written (COMPLETE).
        assert (client.resubmit_ended, client.resubmit_failed) == (3, 1)
        assert p.call("writes_posted") == written + 2  # one WRITE each, none for rs-gone
        with grpc.insecure_channel(standby.address) as ch:
            st = pbg.StatusServiceStub(ch)
            g = st.GetTransfer(pb.GetTransferRequest(transfer_id="rs-gone"), timeout=5)
            assert g.state == pb.TRANSFER_STATE_FAILED and "no agent" in g.detail, g
            w = st.GetTransfer(pb.GetTransferRequest(transfer_id="rs-written"), timeout=5)
            assert w.state == pb.TRANSFER_STATE_COMPLETE and "written before" in w.detail, w
            assert "written_before_failover" in [e.stage for e in w.timeline], w
            with pytest.raises(grpc.RpcError) as err:  # never resubmitted
                st.GetTransfer(pb.GetTransferRequest(transfer_id="rs-settled"), timeout=5)
            assert err.value.code() is grpc.StatusCode.NOT_FOUND
        assert d.check([20, 21], seed=60) == []  # rs-written: intact
        used = [20, 21, 22, 23, 24, 25]
        assert d.call("check_canary", [b for b in range(NB) if b not in used], CANARY) == []
        assert p.call("held") == d.call("held") == []
        # rs-gone ended; the others remain open until the engine settles them.
        assert client.wait_open(lambda open_: open_ == {"rs-registered", "rs-ordered"}, 5.0)
    finally:
        client.close()
        p.stop()
        d.stop()
