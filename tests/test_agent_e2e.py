"""Agents in separate processes with real NIXL, against a real coordinator process."""

from __future__ import annotations

import time

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.kvpair import (
    CANARY,
    NB,
    coord_fixture,  # noqa: F401
    hosts,
    prefill_done,
    register,
    stop_all,
    stubs,
    wait_state,
)


@pytest.mark.parametrize("decode_first", [True, False])
def test_bytes_arrive_intact_in_both_orders(coord: CoordinatorProcess, decode_first: bool) -> None:
    req, status = stubs(coord)
    (p,), (d,) = hosts(coord)
    try:
        src, dst = [3, 17, 4, 40, 41, 9], [50, 2, 33, 34, 8, 61]  # non-contiguous, with runs
        n_tokens = 5 * 16 + 7  # partial last block
        d.call("canary", CANARY)
        p.fill(src, seed=11)
        d.call("expect", ["t1"])
        first, second = (register, prefill_done) if decode_first else (prefill_done, register)
        first(req, "t1", dst if first is register else src, n_tokens)
        second(req, "t1", dst if second is register else src, n_tokens)
        assert d.wait_event("t1").kind is EventKind.KV_READY
        assert p.wait_event("t1").kind is EventKind.BLOCKS_FREE
        assert d.check(dst, seed=11) == []
        untouched = [b for b in range(NB) if b not in dst]
        assert d.call("check_canary", untouched, CANARY) == []
        t = wait_state(status, "t1", pb.TRANSFER_STATE_COMPLETE)
        assert t.state == pb.TRANSFER_STATE_COMPLETE
        assert list(t.outstanding_ranks) == [] and not t.write_may_land
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (0, pb.RANK_STATE_DONE, True)
        ]
    finally:
        stop_all([p], [d])


def test_two_prefill_ranks_into_one_decode_engine(coord: CoordinatorProcess) -> None:
    req, status = stubs(coord)
    ps, ds = hosts(coord, tp=2)
    try:
        src, dst = [1, 5, 9], [7, 3, 12]
        for r, h in enumerate(ps):
            h.fill(src, seed=100 + r)  # each rank holds its own shard of the KV
        for h in ds:
            h.call("expect", ["t2"])
        register(req, "t2", dst, 40)
        prefill_done(req, "t2", src, 40)
        for r, h in enumerate(ds):
            assert h.wait_event("t2").kind is EventKind.KV_READY
            assert h.check(dst, seed=100 + r) == []
        t = wait_state(status, "t2", pb.TRANSFER_STATE_COMPLETE)
        assert sorted(r.prefill_rank for r in t.ranks if r.arrived) == [0, 1]
        assert all(r.state == pb.RANK_STATE_DONE for r in t.ranks)
    finally:
        stop_all(ps, ds)


def test_cancel_before_post_never_writes(coord: CoordinatorProcess) -> None:
    req, status = stubs(coord)
    (p,), (d,) = hosts(coord)
    try:
        src, dst = [1, 2, 3], [10, 20, 30]
        d.call("canary", CANARY)
        p.fill(src, seed=5)
        p.call("pause", True)  # orders queue up instead of being posted
        register(req, "t3", dst, 40)
        t = prefill_done(req, "t3", src, 40)
        assert t.state == pb.TRANSFER_STATE_ORDERED
        # The order is on its way to (or queued in) the prefill agent; cancel it.
        t = req.Cancel(pb.CancelRequest(transfer_id="t3", reason="client left"), timeout=10)
        assert t.state == pb.TRANSFER_STATE_CANCELLED and t.write_may_land
        # The cancel drops the queued order (never posted) and frees the blocks;
        # only then is posting resumed, so a WRITE would show up if it were kept.
        assert p.wait_event("t3").kind is EventKind.BLOCKS_FREE
        p.call("pause", False)
        e = d.wait_event("t3")
        assert e.kind is EventKind.KV_FAILED  # only once no WRITE can land
        t = wait_state(status, "t3", pb.TRANSFER_STATE_CANCELLED)
        assert not t.write_may_land
        assert [r.state for r in t.ranks] == [pb.RANK_STATE_DROPPED]
        assert p.call("writes_posted") == 0
        assert d.call("check_canary", list(range(NB)), CANARY) == []
    finally:
        stop_all([p], [d])


def test_killed_decode_peer_fails_the_transfer(coord: CoordinatorProcess) -> None:
    req, status = stubs(coord)
    (p,), (d,) = hosts(coord)
    try:
        register(req, "t4", [1, 2], 20)
        d.kill()
        prefill_done(req, "t4", [5, 6], 20)
        # The prefill side is told to free its blocks; the timeout only bounds the wait.
        assert p.wait_event("t4", timeout=10).kind is EventKind.BLOCKS_FREE
        t = wait_state(status, "t4", pb.TRANSFER_STATE_FAILED)
        assert t.state == pb.TRANSFER_STATE_FAILED
        assert t.reason in (pb.REASON_AGENT_LOST, pb.REASON_WRITE_FAILED)
    finally:
        stop_all([p], [d])


def test_killed_prefill_mid_transfer_releases_decode(coord: CoordinatorProcess) -> None:
    req, status = stubs(coord)
    (p,), (d,) = hosts(coord)
    try:
        d.call("canary", CANARY)
        p.call("pause", True)  # hold the order so the kill lands mid-transfer
        register(req, "t5", [1, 2], 20)
        prefill_done(req, "t5", [5, 6], 20)
        p.kill()
        t = wait_state(status, "t5", pb.TRANSFER_STATE_FAILED, timeout=5)
        assert t.state == pb.TRANSFER_STATE_FAILED and t.reason == pb.REASON_AGENT_LOST
        # Decode may reuse the blocks only once the dead agent's lease (2 s) ran out.
        e = d.wait_event("t5", timeout=10)
        assert e.kind is EventKind.KV_FAILED
        assert not status.GetTransfer(pb.GetTransferRequest(transfer_id="t5")).write_may_land
        assert d.call("check_canary", [1, 2], CANARY) == []
    finally:
        stop_all([p], [d])


def test_coordinator_restart_agents_reconnect(coord: CoordinatorProcess) -> None:
    req, status = stubs(coord)
    (p,), (d,) = hosts(coord)
    try:
        port = coord.port
        coord.kill()
        restarted = CoordinatorProcess(
            "--lease-s", "2", "--heartbeat-interval-s", "0.5", "--log-level", "WARNING", port=port
        ).start()
        try:
            deadline = time.monotonic() + 20
            engines: list[str] = []
            while time.monotonic() < deadline:
                try:
                    listed = status.ListEngines(pb.ListEnginesRequest(), timeout=2)
                    engines = sorted(e.engine_id for e in listed.engines if e.ready)
                except grpc.RpcError:
                    engines = []
                if engines == ["D", "P"]:
                    break
                time.sleep(0.05)
            assert engines == ["D", "P"], "agents did not re-register after the restart"
            p.fill([4], seed=9)
            d.call("expect", ["t6"])
            register(req, "t6", [8], 10)
            prefill_done(req, "t6", [4], 10)
            assert d.wait_event("t6").kind is EventKind.KV_READY
            assert d.check([8], seed=9) == []
        finally:
            restarted.stop()
    finally:
        stop_all([p], [d])
