"""Property tests: random and malformed input to every RPC never breaks the coordinator.

Every call must end OK or with a status that blames the caller or the state
(never INTERNAL or UNKNOWN), the core's in-flight accounting must stay exact,
and afterwards a normal transfer must still complete while Health says SERVING.

One coordinator runs on its own thread for the whole module; the tests use the
blocking grpc API against it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushkv.controlplane.domain import EngineId
from pushkv.controlplane.settings import CoreSettings
from pushkv.protocol import PROTOCOL_VERSION
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import (
    SimCluster,
    ThreadedCoordinator,
    hello,
    rendezvous,
    wait_terminal,
)

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
}
CALL_TIMEOUT = 10.0
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Live engines (SimCluster, auto-completing) so fuzzed requests reach deep paths.
PREFILL, DECODE = "fz-p", "fz-d"
ENGINES = [PREFILL, DECODE, "nobody", "h-0", "h-1"]
UNARY: dict[str, type[Message]] = {
    "/pushkv.v1.TransferService/BeginTransfer": pb.BeginTransferRequest,
    "/pushkv.v1.TransferService/RegisterDecodeBlocks": pb.RegisterDecodeBlocksRequest,
    "/pushkv.v1.TransferService/ReportPrefillDone": pb.ReportPrefillDoneRequest,
    "/pushkv.v1.TransferService/Cancel": pb.CancelRequest,
    "/pushkv.v1.TransferService/Submit": pb.SubmitRequest,
    "/pushkv.v1.StatusService/GetTransfer": pb.GetTransferRequest,
    "/pushkv.v1.StatusService/ListTransfers": pb.ListTransfersRequest,
    "/pushkv.v1.StatusService/ListEngines": pb.ListEnginesRequest,
}

# ---------------------------------------------------------------- strategies

VALID_ID = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABC0123456789._:@-", min_size=1, max_size=12
).filter(lambda s: s[0].isalnum())
IDS = st.one_of(
    st.just(""),
    VALID_ID,
    st.sampled_from(["t0", "t1", "t2", "t3", "a b", "x|y", "-lead", "é", "\x00"]),
    st.text(max_size=16),
    st.text(alphabet="ab", min_size=200, max_size=3000),  # around and past max_id_len
)
SMALL_IDS = st.sampled_from([f"t{i}" for i in range(64)])
ENGINE_IDS = st.one_of(st.sampled_from(ENGINES), IDS)
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
BLOCK_ID = st.one_of(st.integers(0, 40), st.integers(1000, 1100), UINT32)
GROUP = st.one_of(
    st.lists(BLOCK_ID, max_size=8),
    st.lists(st.sampled_from([0, 1, 1, 2, 2**32 - 1]), max_size=8),  # duplicates
    # One very long group (past max_blocks_per_group when n > 65536).
    st.builds(
        lambda n, start: list(range(start, start + n)),
        st.integers(0, 70_000),
        st.one_of(st.just(0), st.integers(0, 2**32 - 70_001)),
    ),
)
GROUPS = st.one_of(
    st.lists(GROUP, max_size=3),
    st.integers(0, 40).map(lambda n: [[i % 7] for i in range(n)]),  # many groups
)
TOKENS = st.one_of(st.integers(0, 100), UINT32)
STATE_VALUES = st.one_of(st.integers(0, 11), st.integers(-(2**31), 2**31 - 1))
REASONS = st.one_of(st.text(max_size=20), st.text(alphabet="r", min_size=1000, max_size=1100))


def _blocks(groups: list[list[int]]) -> list[pb.BlockIds]:
    return [pb.BlockIds(ids=g) for g in groups]


@st.composite
def plausible_arrival(draw: st.DrawFn, decode: bool) -> tuple[str, str, list[list[int]], int]:
    """A well-formed arrival for the live engines, so fuzzing reaches the rendezvous."""
    i = draw(st.integers(0, 63))
    tid = f"t{i}"
    engine = DECODE if decode else PREFILL
    if draw(st.integers(0, 9)) == 0:
        engine = PREFILL if decode else DECODE  # wrong role
    # Both sides of one transfer usually agree on the prompt length.
    num_tokens = 1 + 7 * i if draw(st.integers(0, 9)) else draw(st.integers(1, 500))
    need = -(-num_tokens // 16)
    n = draw(st.integers(0, need) if decode else st.integers(need, need + 2))
    ids = draw(st.lists(st.integers(0, 1023), min_size=n, max_size=n, unique=True))
    return tid, engine, [ids], num_tokens


@st.composite
def arrival_requests(draw: st.DrawFn, decode: bool) -> Any:
    if draw(st.booleans()):
        tid, engine, groups, tokens = draw(plausible_arrival(decode))
    else:
        tid, engine, groups, tokens = draw(IDS), draw(ENGINE_IDS), draw(GROUPS), draw(TOKENS)
    if decode:
        return pb.RegisterDecodeBlocksRequest(
            transfer_id=tid, decode_engine_id=engine, block_ids=_blocks(groups), num_tokens=tokens
        )
    return pb.ReportPrefillDoneRequest(
        transfer_id=tid, prefill_engine_id=engine, block_ids=_blocks(groups), num_tokens=tokens
    )


def cancel_requests() -> st.SearchStrategy[pb.CancelRequest]:
    return st.builds(pb.CancelRequest, transfer_id=st.one_of(SMALL_IDS, IDS), reason=REASONS)


@st.composite
def transfer_calls(draw: st.DrawFn) -> pb.TransferCall:
    kind = draw(st.sampled_from(["register", "prefill_done", "cancel", "empty"]))
    if kind == "register":
        return pb.TransferCall(register=draw(arrival_requests(True)))
    if kind == "prefill_done":
        return pb.TransferCall(prefill_done=draw(arrival_requests(False)))
    if kind == "cancel":
        return pb.TransferCall(cancel=draw(cancel_requests()))
    return pb.TransferCall()


@st.composite
def unary_calls(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(sorted(UNARY)))
    name = kind.rsplit("/", 1)[1]
    if name == "BeginTransfer":
        req: Any = pb.BeginTransferRequest(
            transfer_id=draw(st.one_of(SMALL_IDS, IDS)),
            prefill_engine_id=draw(st.one_of(st.just(""), ENGINE_IDS)),
            decode_engine_id=draw(st.one_of(st.just(""), ENGINE_IDS)),
        )
    elif name in ("RegisterDecodeBlocks", "ReportPrefillDone"):
        req = draw(arrival_requests(name == "RegisterDecodeBlocks"))
    elif name == "Cancel":
        req = draw(cancel_requests())
    elif name == "Submit":
        req = pb.SubmitRequest(calls=draw(st.lists(transfer_calls(), max_size=6)))
    elif name == "GetTransfer":
        req = pb.GetTransferRequest(transfer_id=draw(st.one_of(SMALL_IDS, IDS)))
    elif name == "ListTransfers":
        req = pb.ListTransfersRequest(
            states=[
                pb.TransferState.ValueType(s) for s in draw(st.lists(STATE_VALUES, max_size=4))
            ],
            engine_id=draw(st.one_of(st.just(""), ENGINE_IDS)),
            min_age_ms=draw(st.one_of(st.just(0), UINT32)),
            max_age_ms=draw(st.one_of(st.just(0), UINT32)),
            limit=draw(st.one_of(st.just(0), st.integers(1, 5), UINT32)),
        )
    else:
        req = pb.ListEnginesRequest(role=pb.Role.ValueType(draw(STATE_VALUES)))
    return kind, req


@st.composite
def layouts(draw: st.DrawFn) -> pb.KVLayout:
    regions = draw(
        st.lists(
            st.builds(
                pb.KVRegion,
                base_addr=st.one_of(st.just(0x1000), UINT64),
                block_len=st.one_of(st.just(4096), UINT64),
                num_blocks=st.one_of(st.just(1024), UINT32),
                device_id=UINT32,
                group=st.one_of(st.just(0), st.integers(0, 3), UINT32),
                name=st.text(max_size=8),
            ),
            max_size=3,
        )
    )
    return pb.KVLayout(
        tokens_per_block=draw(st.one_of(st.just(16), UINT32)),
        regions=regions,
        memory_kind=draw(st.sampled_from(["", "DRAM", "VRAM", "???"])),
        compat_hash=draw(st.text(max_size=8)),
    )


@st.composite
def hellos(draw: st.DrawFn) -> pb.AgentMessage:
    if draw(st.booleans()):  # mostly valid, so later messages get handled
        tp = draw(st.integers(1, 3))
        return hello(
            draw(st.sampled_from(["h-0", "h-1", "h-2"])),
            draw(st.sampled_from(["prefill", "decode"])),
            draw(st.integers(0, tp - 1)),
            tp,
            draw(st.sampled_from(["i1", "i2", "i3"])),
        )
    return pb.AgentMessage(
        hello=pb.AgentHello(
            protocol_version=draw(st.one_of(st.just(PROTOCOL_VERSION), UINT32)),
            identity=pb.AgentIdentity(
                engine_id=draw(st.one_of(st.sampled_from(["h-0", "h-1"]), IDS)),
                role=pb.Role.ValueType(draw(STATE_VALUES)),
                tp_rank=draw(st.one_of(st.integers(0, 3), UINT32)),
                tp_size=draw(st.one_of(st.integers(0, 3), UINT32)),
                incarnation=draw(st.one_of(st.just("i1"), IDS)),
            ),
            nixl_agent_name=draw(st.one_of(st.just("n"), IDS)),
            nixl_metadata=draw(st.binary(max_size=64)),
            layout=draw(layouts()),
            api_url=draw(st.one_of(st.just(""), st.text(max_size=3000))),
        )
    )


@st.composite
def agent_messages(draw: st.DrawFn) -> pb.AgentMessage:
    kind = draw(st.sampled_from(["hello", "heartbeat", "write", "arrival", "empty", "batch"]))
    if kind == "hello":
        return draw(hellos())
    if kind == "batch":  # may hold what a batch must not: a hello, a nested batch
        return pb.AgentMessage(
            batch=pb.AgentBatch(messages=draw(st.lists(agent_messages(), max_size=4)))
        )
    if kind == "heartbeat":
        return pb.AgentMessage(heartbeat=pb.Heartbeat(seq=draw(UINT64)))
    if kind == "write":
        return pb.AgentMessage(
            write=pb.WriteReport(
                order_id=draw(IDS),
                transfer_id=draw(IDS),
                status=pb.WriteStatus.ValueType(draw(STATE_VALUES)),
                detail=draw(st.text(max_size=20)),
                bytes=draw(UINT64),
                descriptors=draw(UINT32),
            )
        )
    if kind == "arrival":
        return pb.AgentMessage(
            arrival=pb.ArrivalReport(
                transfer_id=draw(IDS), prefill_ranks=draw(st.lists(UINT32, max_size=4))
            )
        )
    return pb.AgentMessage()


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedCoordinator]:
    with ThreadedCoordinator(CoreSettings()) as tc:
        cluster = SimCluster(tc.address, PREFILL, DECODE, heartbeat_interval=0.5)
        tc.run(cluster.start())
        yield tc
        tc.run(cluster.close())


@pytest.fixture(scope="module")
def channel(server: ThreadedCoordinator) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(
        server.address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as ch:
        yield ch


def code_of(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


class _Cancellable(Protocol):
    def cancel(self) -> object: ...


def cancel_call(call: _Cancellable) -> None:
    """Cancel a blocking call (grpc-stubs leave RpcContext.cancel unannotated)."""
    call.cancel()


def assert_allowed(code: grpc.StatusCode, what: object) -> None:
    assert code in ALLOWED, f"{code} for {what!r}"[:2000]


def check_accounting(server: ThreadedCoordinator) -> None:
    """The core's in-flight counters agree with its transfers (read on its loop)."""

    async def snapshot() -> tuple[int, int, dict[EngineId, int], dict[EngineId, int], bool]:
        assert server.coordinator is not None
        core = server.coordinator.runtime.core
        live = [t for t in core.transfers() if not t.state.terminal]
        per_engine: dict[EngineId, int] = {}
        for t in live:
            for e in t.counted:
                per_engine[e] = per_engine.get(e, 0) + 1
        # The index an agent's loss scans holds exactly the transfers not ended.
        indexed = core._book.live == {t.transfer_id: t for t in live}
        return core.inflight, len(live), dict(core._book.by_engine), per_engine, indexed

    inflight, live, by_engine, counted, indexed = server.run(snapshot())
    assert inflight == live
    assert by_engine == counted
    assert indexed


# ---------------------------------------------------------------- properties


@FUZZ
@given(calls=st.lists(unary_calls(), min_size=1, max_size=4))
def test_unary_rpcs_with_random_fields(
    server: ThreadedCoordinator, channel: grpc.Channel, calls: list[tuple[str, Any]]
) -> None:
    for path, req in calls:
        if path.endswith("/Submit"):
            submit = pbg.TransferServiceStub(channel).Submit
            resp = submit(req, timeout=CALL_TIMEOUT)  # a batch within the limit never fails
            assert len(resp.results) == len(req.calls)
            for call, result in zip(req.calls, resp.results, strict=True):
                assert_allowed(grpc.StatusCode(_CODE[result.code]), call)
                if call.WhichOneof("kind") is None:
                    assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            continue
        fn = channel.unary_unary(
            path, request_serializer=type(req).SerializeToString, response_deserializer=None
        )
        assert_allowed(code_of(lambda: fn(req, timeout=CALL_TIMEOUT)), req)  # noqa: B023
    check_accounting(server)


_CODE = {c.value[0]: c.value for c in grpc.StatusCode}


_SEQ = iter(range(10**9))
TERMINAL = [
    pb.TRANSFER_STATE_COMPLETE,
    pb.TRANSFER_STATE_FAILED,
    pb.TRANSFER_STATE_CANCELLED,
    pb.TRANSFER_STATE_EXPIRED,
]


@FUZZ
@given(
    num_tokens=st.integers(1, 200),
    data=st.data(),
    extra=st.lists(st.sampled_from(["retry-d", "retry-p", "conflict", "cancel"]), max_size=3),
    decode_first=st.booleans(),
)
def test_random_interleavings_of_one_transfer(
    server: ThreadedCoordinator,
    channel: grpc.Channel,
    num_tokens: int,
    data: st.DataObject,
    extra: list[str],
    decode_first: bool,
) -> None:
    """Both arrivals plus retries, conflicts and cancels in any order."""
    tid = f"il-{next(_SEQ)}"
    need = -(-num_tokens // 16)
    ids = st.integers(0, 1023)
    d_ids = data.draw(st.lists(ids, max_size=need, unique=True), label="decode blocks")
    p_ids = data.draw(
        st.lists(ids, min_size=need, max_size=need + 2, unique=True), label="prefill blocks"
    )
    dec = pb.RegisterDecodeBlocksRequest(
        transfer_id=tid, decode_engine_id=DECODE, block_ids=_blocks([d_ids]), num_tokens=num_tokens
    )
    pre = pb.ReportPrefillDoneRequest(
        transfer_id=tid,
        prefill_engine_id=PREFILL,
        block_ids=_blocks([p_ids]),
        num_tokens=num_tokens,
    )
    ops = ["decode", "prefill"] if decode_first else ["prefill", "decode"]
    for op in extra:
        ops.insert(data.draw(st.integers(0, len(ops)), label="position"), op)
    stub = pbg.TransferServiceStub(channel)
    bad = pb.RegisterDecodeBlocksRequest()
    bad.CopyFrom(dec)
    bad.num_tokens = num_tokens + 1  # disagrees with the prefill side
    decode_sent: str | None = None  # the decode payload the coordinator kept
    prefill_sent = False
    cancelled = cancelled_early = False
    for op in ops:
        if op in ("decode", "retry-d", "conflict"):
            mine = "bad" if op == "conflict" else "good"
            req = bad if op == "conflict" else dec
            code = code_of(lambda: stub.RegisterDecodeBlocks(req, timeout=CALL_TIMEOUT))  # noqa: B023
            # A stored payload must match; none is stored once the transfer ended.
            ok = decode_sent in (None, mine)
            want = grpc.StatusCode.OK if ok else grpc.StatusCode.ALREADY_EXISTS
            if decode_sent is None and not cancelled:
                decode_sent = mine
        elif op in ("prefill", "retry-p"):
            code = code_of(lambda: stub.ReportPrefillDone(pre, timeout=CALL_TIMEOUT))
            want = grpc.StatusCode.OK
            prefill_sent = prefill_sent or not cancelled
        else:
            code = code_of(lambda: stub.Cancel(pb.CancelRequest(transfer_id=tid), timeout=5))
            want = grpc.StatusCode.OK
            cancelled_early |= not (decode_sent and prefill_sent)
            cancelled = True
        assert_allowed(code, (op, ops))
        assert code == want, (op, ops, code)

    # Wait (on a watch, with a deadline) for the transfer's terminal state.
    events = pbg.StatusServiceStub(channel).WatchTransfers(
        pb.WatchTransfersRequest(states=TERMINAL, include_existing=True), timeout=CALL_TIMEOUT
    )
    try:
        final = next(ev.transfer for ev in events if ev.transfer.transfer_id == tid)
    finally:
        cancel_call(events)
    if cancelled_early:
        assert final.state == pb.TRANSFER_STATE_CANCELLED, (ops, final)
    elif decode_sent == "bad":
        assert final.state == pb.TRANSFER_STATE_FAILED, (ops, final)
        assert final.reason == pb.REASON_MISMATCH
    elif "cancel" in ops:
        assert final.state in (pb.TRANSFER_STATE_CANCELLED, pb.TRANSFER_STATE_COMPLETE)
    else:
        assert final.state == pb.TRANSFER_STATE_COMPLETE, (ops, final)
        want_reason = pb.REASON_NOTHING_TO_WRITE if not d_ids else pb.REASON_UNSPECIFIED
        assert final.reason == want_reason
    check_accounting(server)


@FUZZ
@given(path=st.sampled_from(sorted(UNARY)), payload=st.binary(max_size=300))
def test_unary_rpcs_with_garbage_bytes(channel: grpc.Channel, path: str, payload: bytes) -> None:
    # No serializers: raw bytes both ways.
    fn = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    code = code_of(lambda: fn(payload, timeout=CALL_TIMEOUT))
    assert_allowed(code, payload)
    try:
        UNARY[path].FromString(payload)
    except Exception:
        assert code == grpc.StatusCode.INVALID_ARGUMENT


_VALID_STATES = frozenset(pb.TransferState.values()) - {pb.TRANSFER_STATE_UNSPECIFIED}


@FUZZ
@given(
    states=st.lists(STATE_VALUES, max_size=3),
    engine_id=st.one_of(st.just(""), ENGINE_IDS),
    include_existing=st.booleans(),
)
def test_watch_transfers_with_random_filters(
    channel: grpc.Channel, states: list[int], engine_id: str, include_existing: bool
) -> None:
    req = pb.WatchTransfersRequest(
        states=[pb.TransferState.ValueType(s) for s in states],
        engine_id=engine_id,
        include_existing=include_existing,
    )
    stub = pbg.StatusServiceStub(channel)
    if any(s not in _VALID_STATES for s in states):
        code = code_of(lambda: list(stub.WatchTransfers(req, timeout=CALL_TIMEOUT)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, req
        return
    # A valid watch streams until the client goes away: every event must match.
    call = stub.WatchTransfers(req, timeout=0.05)
    code = grpc.StatusCode.OK
    try:
        for ev in call:
            assert not states or ev.transfer.state in states
            assert not engine_id or engine_id in (
                ev.transfer.prefill_engine_id,
                ev.transfer.decode_engine_id,
            )
    except grpc.RpcError as exc:
        code = exc.code()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, req


@FUZZ
@given(
    first=st.one_of(hellos(), hellos(), agent_messages()),
    rest=st.lists(agent_messages(), max_size=5),
    empty=st.integers(0, 19),
)
def test_agent_stream_with_random_messages(
    server: ThreadedCoordinator,
    channel: grpc.Channel,
    first: pb.AgentMessage,
    rest: list[pb.AgentMessage],
    empty: int,
) -> None:
    msgs = [] if empty == 0 else [first, *rest]
    stub = pbg.AgentServiceStub(channel)
    replies: list[pb.CoordinatorMessage] = []

    def run() -> None:
        replies.extend(stub.AgentStream(iter(msgs), timeout=CALL_TIMEOUT))

    code = code_of(run)
    assert_allowed(code, msgs)
    first_is_hello = bool(msgs) and msgs[0].WhichOneof("kind") == "hello"
    if not first_is_hello:
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    if code == grpc.StatusCode.OK:
        assert replies and replies[0].WhichOneof("kind") == "welcome"
    check_accounting(server)


@FUZZ
@given(
    with_hello=st.booleans(),
    frames=st.lists(st.binary(max_size=200), min_size=1, max_size=4),
)
def test_agent_stream_with_garbage_bytes(
    channel: grpc.Channel, with_hello: bool, frames: list[bytes]
) -> None:
    raw = channel.stream_stream(  # raw bytes
        "/pushkv.v1.AgentService/AgentStream", request_serializer=None, response_deserializer=None
    )
    if with_hello:
        frames = [hello("h-raw", "decode").SerializeToString(), *frames]
    code = code_of(lambda: list(raw(iter(frames), timeout=CALL_TIMEOUT)))
    assert_allowed(code, frames)
    undecodable = False
    for f in frames:
        try:
            pb.AgentMessage.FromString(f)
        except Exception:
            undecodable = True
            break
    if undecodable:
        assert code == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- still healthy


async def _full_flow(address: str) -> pb.TransferStatus:
    async with (
        SimCluster(address, "final-p", "final-d", auto_complete=True),
        grpc.aio.insecure_channel(address) as ch,
    ):
        st_ = await rendezvous(ch, "final-1", prefill_engine="final-p", decode_engine="final-d")
        assert st_.state == pb.TRANSFER_STATE_ORDERED, st_
        return (await wait_terminal(ch, ["final-1"]))["final-1"]


def test_zz_after_the_fuzzing_a_normal_transfer_completes(
    server: ThreadedCoordinator, channel: grpc.Channel
) -> None:
    got = asyncio.run(_full_flow(server.address))
    assert got.state == pb.TRANSFER_STATE_COMPLETE and not got.outstanding_ranks
    # The module's own auto-completing engines also still work.
    with grpc.insecure_channel(server.address) as ch:
        stub = pbg.TransferServiceStub(ch)
        stub.RegisterDecodeBlocks(
            pb.RegisterDecodeBlocksRequest(
                transfer_id="final-2",
                decode_engine_id=DECODE,
                block_ids=_blocks([[7]]),
                num_tokens=16,
            ),
            timeout=CALL_TIMEOUT,
        )
        st_ = stub.ReportPrefillDone(
            pb.ReportPrefillDoneRequest(
                transfer_id="final-2",
                prefill_engine_id=PREFILL,
                block_ids=_blocks([[3]]),
                num_tokens=16,
            ),
            timeout=CALL_TIMEOUT,
        )
        assert st_.state in (pb.TRANSFER_STATE_ORDERED, pb.TRANSFER_STATE_COMPLETE)
        events = pbg.StatusServiceStub(ch).WatchTransfers(
            pb.WatchTransfersRequest(
                states=[pb.TRANSFER_STATE_COMPLETE], engine_id=DECODE, include_existing=True
            ),
            timeout=CALL_TIMEOUT,
        )
        try:
            for ev in events:
                if ev.transfer.transfer_id == "final-2":
                    break
        finally:
            cancel_call(events)
        for service in ("", "pushkv.v1.TransferService"):
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT
            )
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    check_accounting(server)
