"""Mutual TLS and per-identity authorisation, against real servers and real agents.

Certificates are generated when the tests run (pushkv/tools/devpki.py); no key
is committed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.controlplane.server import Coordinator, ServerSettings, start
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.net.tls import TLSFiles
from pushkv.protocol import PROTOCOL_VERSION
from pushkv.relay.server import Relay, RelaySettings
from pushkv.tools.devpki import make_pki
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_pki(d, engines=["P", "D"], operators=["alice"])
    make_pki(d / "other", engines=["D"])  # a second, untrusted CA
    return d


def files(pki: Path, name: str, ca: Path | None = None) -> TLSFiles:
    return TLSFiles(str(ca or pki / "ca.pem"), str(pki / f"{name}.pem"), str(pki / f"{name}.key"))


@pytest.fixture
async def coord(pki: Path) -> AsyncIterator[Coordinator]:
    settings = ServerSettings(port=0, host="127.0.0.1", tls=files(pki, "coordinator"))
    c = await start(settings)
    yield c
    await c.stop(0)


def chan(c: Coordinator, tls: TLSFiles) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(f"localhost:{c.port}", tls.channel_credentials())


def hello(engine: str, role: pb.Role.ValueType) -> pb.AgentMessage:
    return pb.AgentMessage(
        hello=pb.AgentHello(
            protocol_version=PROTOCOL_VERSION,
            identity=pb.AgentIdentity(
                engine_id=engine, role=role, tp_rank=0, tp_size=1, incarnation="i1"
            ),
            nixl_agent_name=f"{engine}-agent",
            nixl_metadata=b"md",
            layout=pb.KVLayout(
                tokens_per_block=16,
                regions=[pb.KVRegion(base_addr=4096, block_len=1024, num_blocks=32)],
            ),
        )
    )


async def open_agent(
    c: Coordinator, tls: TLSFiles, engine: str, role: pb.Role.ValueType
) -> grpc.aio.StreamStreamCall[pb.AgentMessage, pb.CoordinatorMessage]:
    call = pbg.AgentServiceStub(chan(c, tls)).AgentStream(None)
    # A refused caller may see the stream end before its hello is written.
    with contextlib.suppress(grpc.aio.AioRpcError):
        await call.write(hello(engine, role))
    return call


def register(engine: str = "D", tid: str = "t1") -> pb.RegisterDecodeBlocksRequest:
    return pb.RegisterDecodeBlocksRequest(
        transfer_id=tid, decode_engine_id=engine, block_ids=[pb.BlockIds(ids=[1, 2])], num_tokens=20
    )


async def received(
    call: grpc.aio.StreamStreamCall[pb.AgentMessage, pb.CoordinatorMessage],
) -> pb.CoordinatorMessage:
    """The next message down an agent stream (the stream must not have ended)."""
    msg = await call.read()
    assert isinstance(msg, pb.CoordinatorMessage), "the stream ended"
    return msg


async def code_of(coro: Awaitable[object]) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_missing_or_foreign_certificate_is_rejected(coord: Coordinator, pki: Path) -> None:
    req = pb.ListTransfersRequest()
    insecure = pbg.StatusServiceStub(grpc.aio.insecure_channel(coord.address))
    assert await code_of(insecure.ListTransfers(req, timeout=5)) == grpc.StatusCode.UNAVAILABLE
    no_cert = grpc.aio.secure_channel(
        f"localhost:{coord.port}",
        grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes()),
    )
    assert await code_of(pbg.StatusServiceStub(no_cert).ListTransfers(req, timeout=5)) == (
        grpc.StatusCode.UNAVAILABLE
    )
    # A certificate from another CA, even with a valid-looking identity.
    foreign = files(pki / "other", "engine-D", ca=pki / "ca.pem")
    stub = pbg.TransferServiceStub(chan(coord, foreign))
    assert await code_of(stub.RegisterDecodeBlocks(register(), timeout=5)) == (
        grpc.StatusCode.UNAVAILABLE
    )
    # The operator's certificate works for the read-only API.
    ok = pbg.StatusServiceStub(chan(coord, files(pki, "operator-alice")))
    assert await code_of(ok.ListTransfers(req, timeout=5)) == grpc.StatusCode.OK


async def test_operator_is_read_only(coord: Coordinator, pki: Path) -> None:
    op = chan(coord, files(pki, "operator-alice"))
    transfers = pbg.TransferServiceStub(op)
    assert await code_of(transfers.RegisterDecodeBlocks(register(), timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert await code_of(transfers.Cancel(pb.CancelRequest(transfer_id="t1"), timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    call = await open_agent(coord, files(pki, "operator-alice"), "D", pb.ROLE_DECODE)
    assert await code_of(call.read()) == grpc.StatusCode.PERMISSION_DENIED
    engines = await pbg.StatusServiceStub(op).ListEngines(pb.ListEnginesRequest(), timeout=5)
    assert list(engines.engines) == []


async def test_engine_acts_only_for_itself(coord: Coordinator, pki: Path) -> None:
    p_tls, d_tls = files(pki, "engine-P"), files(pki, "engine-D")
    # P's certificate cannot open D's agent stream ...
    spoof = await open_agent(coord, p_tls, "D", pb.ROLE_DECODE)
    assert await code_of(spoof.read()) == grpc.StatusCode.PERMISSION_DENIED
    # ... but D's can, and P's can open P's.
    d_call = await open_agent(coord, d_tls, "D", pb.ROLE_DECODE)
    assert (await received(d_call)).WhichOneof("kind") == "welcome"
    p_call = await open_agent(coord, p_tls, "P", pb.ROLE_PREFILL)
    assert (await received(p_call)).WhichOneof("kind") == "welcome"

    p_stub = pbg.TransferServiceStub(chan(coord, p_tls))
    d_stub = pbg.TransferServiceStub(chan(coord, d_tls))
    # P cannot register blocks as D, nor report prefill done as D.
    assert await code_of(p_stub.RegisterDecodeBlocks(register("D"), timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    as_d = pb.ReportPrefillDoneRequest(
        transfer_id="t1", prefill_engine_id="D", block_ids=[pb.BlockIds(ids=[1, 2])], num_tokens=20
    )
    assert await code_of(d_stub.ReportPrefillDone(as_d, timeout=5)) == (
        grpc.StatusCode.FAILED_PRECONDITION  # D is authorised for itself, but is no prefill
    )
    assert await code_of(p_stub.ReportPrefillDone(as_d, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # D registers for itself; the router may cancel; an engine outside the
    # transfer may not.
    st = await d_stub.RegisterDecodeBlocks(register("D", "t2"), timeout=5)
    assert st.state == pb.TRANSFER_STATE_REGISTERED
    assert await code_of(p_stub.Cancel(pb.CancelRequest(transfer_id="t2"), timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    router = pbg.TransferServiceStub(chan(coord, files(pki, "router")))
    assert await code_of(router.RegisterDecodeBlocks(register("D", "t3"), timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    st = await router.Cancel(pb.CancelRequest(transfer_id="t2", reason="test"), timeout=5)
    assert st.state == pb.TRANSFER_STATE_CANCELLED
    d_call.cancel()
    p_call.cancel()


async def test_submit_authorizes_each_call_like_its_unary_rpc(
    coord: Coordinator, pki: Path
) -> None:
    d_call = await open_agent(coord, files(pki, "engine-D"), "D", pb.ROLE_DECODE)
    assert (await received(d_call)).WhichOneof("kind") == "welcome"
    denied = grpc.StatusCode.PERMISSION_DENIED.value[0]
    ok = grpc.StatusCode.OK.value[0]
    as_p = pb.ReportPrefillDoneRequest(
        transfer_id="t3", prefill_engine_id="P", block_ids=[pb.BlockIds(ids=[1, 2])], num_tokens=20
    )
    d = pbg.TransferServiceStub(chan(coord, files(pki, "engine-D")))
    r = await d.Submit(
        pb.SubmitRequest(
            calls=[
                pb.TransferCall(register=register("D", "t1")),  # its own engine
                pb.TransferCall(register=register("P", "t2")),  # another engine's
                pb.TransferCall(prefill_done=as_p),
            ]
        ),
        timeout=5,
    )
    assert [x.code for x in r.results] == [ok, denied, denied]
    assert r.results[0].state == pb.TRANSFER_STATE_REGISTERED
    assert "engine:D may not act for engine 'P'" in r.results[1].message

    # P may not cancel a transfer it is not part of; the router may, but the
    # router may not register blocks.
    p = pbg.TransferServiceStub(chan(coord, files(pki, "engine-P")))
    cancel_t1 = pb.TransferCall(cancel=pb.CancelRequest(transfer_id="t1", reason="test"))
    r = await p.Submit(pb.SubmitRequest(calls=[cancel_t1]), timeout=5)
    assert [x.code for x in r.results] == [denied]
    router = pbg.TransferServiceStub(chan(coord, files(pki, "router")))
    r = await router.Submit(
        pb.SubmitRequest(calls=[pb.TransferCall(register=register("D", "t4")), cancel_t1]),
        timeout=5,
    )
    assert [x.code for x in r.results] == [denied, ok]
    assert r.results[1].state == pb.TRANSFER_STATE_CANCELLED
    # An operator may not submit at all: the RPC itself is refused.
    op = pbg.TransferServiceStub(chan(coord, files(pki, "operator-alice")))
    assert await code_of(op.Submit(pb.SubmitRequest(), timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    d_call.cancel()


async def test_a_relay_carries_submits_for_its_nodes_engine_only(
    coord: Coordinator, pki: Path
) -> None:
    """A node relay dialing with engine:D's certificate: the Submits it carries
    are authorized with that identity, call by call, as D's own would be."""
    d_call = await open_agent(coord, files(pki, "engine-D"), "D", pb.ROLE_DECODE)
    assert (await received(d_call)).WhichOneof("kind") == "welcome"
    settings = RelaySettings(
        coordinators=f"localhost:{coord.port}", listen="127.0.0.1:0", tls=files(pki, "engine-D")
    )
    relay = await Relay(settings).start()
    try:
        async with grpc.aio.insecure_channel(relay.address) as ch:
            r = await pbg.TransferServiceStub(ch).Submit(
                pb.SubmitRequest(
                    calls=[
                        pb.TransferCall(register=register("D", "r1")),  # its own engine
                        pb.TransferCall(register=register("P", "r2")),  # another engine's
                    ]
                ),
                timeout=10,
            )
        denied = grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert [x.code for x in r.results] == [grpc.StatusCode.OK.value[0], denied]
        assert r.results[0].state == pb.TRANSFER_STATE_REGISTERED
        assert "engine:D may not act for engine 'P'" in r.results[1].message
        assert relay.upstream.submits == 1  # carried on the relay's mTLS stream
    finally:
        await relay.stop()
        d_call.cancel()


@pytest.fixture
def tls_coord_process(pki: Path) -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess(
        "--tls-ca",
        str(pki / "ca.pem"),
        "--tls-cert",
        str(pki / "coordinator.pem"),
        "--tls-key",
        str(pki / "coordinator.key"),
        "--log-level",
        "WARNING",
    ).start()
    yield c
    c.stop()


def test_agents_push_over_mutual_tls(tls_coord_process: CoordinatorProcess, pki: Path) -> None:
    address = f"localhost:{tls_coord_process.port}"

    def spec(engine: str, role: str) -> HostSpec:
        f = files(pki, f"engine-{engine}")
        return HostSpec(
            address, engine, role, num_blocks=16, tls_ca=f.ca, tls_cert=f.cert, tls_key=f.key
        )

    p, d = KVHost(spec("P", "prefill")).start(), KVHost(spec("D", "decode")).start()
    try:
        p.fill([1, 4], seed=3)
        d.call("expect", ["tls-1"])
        d_stub = pbg.TransferServiceStub(
            grpc.secure_channel(address, files(pki, "engine-D").channel_credentials())
        )
        p_stub = pbg.TransferServiceStub(
            grpc.secure_channel(address, files(pki, "engine-P").channel_credentials())
        )
        d_stub.RegisterDecodeBlocks(register("D", "tls-1"), timeout=10)
        p_stub.ReportPrefillDone(
            pb.ReportPrefillDoneRequest(
                transfer_id="tls-1",
                prefill_engine_id="P",
                block_ids=[pb.BlockIds(ids=[1, 4])],
                num_tokens=20,
            ),
            timeout=10,
        )
        assert d.wait_event("tls-1").kind is EventKind.KV_READY
        assert d.check([1, 2], seed=3) == []
    finally:
        p.stop()
        d.stop()
