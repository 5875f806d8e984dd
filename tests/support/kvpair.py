"""KV hosts (pushkv/harness/kvhost.py: real agents and real NIXL in their own
processes) against a real coordinator process: the fixtures and the calls
that the KV-host tests share.

Import the fixtures into a test module to make them available there::

    from tests.support.kvpair import coord_fixture, pair_fixture  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

CANARY = 0x5A
NB = 64


@pytest.fixture(name="coord")
def coord_fixture() -> Iterator[CoordinatorProcess]:
    """A coordinator process with a short lease, for KV hosts."""
    c = CoordinatorProcess(
        "--lease-s", "2", "--heartbeat-interval-s", "0.5", "--log-level", "WARNING"
    ).start()
    yield c
    c.stop()


def stubs(c: CoordinatorProcess) -> tuple[pbg.TransferServiceStub, pbg.StatusServiceStub]:
    ch = grpc.insecure_channel(c.address)
    return pbg.TransferServiceStub(ch), pbg.StatusServiceStub(ch)


def hosts(c: CoordinatorProcess, tp: int = 1) -> tuple[list[KVHost], list[KVHost]]:
    p = [KVHost(HostSpec(c.address, "P", "prefill", r, tp, NB)) for r in range(tp)]
    d = [KVHost(HostSpec(c.address, "D", "decode", r, tp, NB)) for r in range(tp)]
    for h in (*p, *d):
        h.start()
    return p, d


def register(req: pbg.TransferServiceStub, tid: str, dst: list[int], n: int) -> pb.TransferStatus:
    return req.RegisterDecodeBlocks(
        pb.RegisterDecodeBlocksRequest(
            transfer_id=tid, decode_engine_id="D", block_ids=[pb.BlockIds(ids=dst)], num_tokens=n
        ),
        timeout=10,
    )


def prefill_done(
    req: pbg.TransferServiceStub, tid: str, src: list[int], n: int
) -> pb.TransferStatus:
    return req.ReportPrefillDone(
        pb.ReportPrefillDoneRequest(
            transfer_id=tid, prefill_engine_id="P", block_ids=[pb.BlockIds(ids=src)], num_tokens=n
        ),
        timeout=10,
    )


def wait_state(
    status: pbg.StatusServiceStub, tid: str, state: int, timeout: float = 10
) -> pb.TransferStatus:
    """Watch the transfer until it reaches `state`; return its last status."""
    return wait_states(status, tid, {state}, timeout)


def wait_states(
    status: pbg.StatusServiceStub, tid: str, states: set[int], timeout: float = 10
) -> pb.TransferStatus:
    """Watch the transfer until it reaches one of `states`; its last status."""
    last = status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)
    if last.state in states:
        return last
    events = status.WatchTransfers(pb.WatchTransfersRequest(include_existing=True), timeout=timeout)
    try:
        for ev in events:
            if ev.transfer.transfer_id == tid:
                last = ev.transfer
                if last.state in states:
                    break
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        events.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs: RpcContext.cancel is unannotated
    return last


def stop_all(*groups: list[KVHost]) -> None:
    for g in groups:
        for h in g:
            h.stop()


@pytest.fixture(name="pair")
def pair_fixture(coord: CoordinatorProcess) -> Iterator[tuple[KVHost, KVHost]]:
    """One prefill host "P" and one decode host "D", TP 1."""
    (p,), (d,) = hosts(coord)
    yield p, d
    stop_all([p], [d])


def begin(req: pbg.TransferServiceStub, tid: str) -> None:
    req.BeginTransfer(
        pb.BeginTransferRequest(transfer_id=tid, prefill_engine_id="P", decode_engine_id="D"),
        timeout=10,
    )


def stages(status: pbg.StatusServiceStub, tid: str) -> list[str]:
    t = status.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)
    return [e.stage for e in t.timeline]
